"""GPT-J on vLLM: GPT-2's containers, a parallel one-tensor block, ``out_proj``."""

from vllm.model_executor.models import gpt_j as vllm_gpt_j

from ...components import vllm as on_vllm
from .._layouts import GPT2_RENAME, vllm_classes

RENAME = GPT2_RENAME
Layer, Attention, Mlp = vllm_classes(__name__, layer=on_vllm.Layer, OUTPUT_PROJECTION="out_proj")
ENVOYS = {vllm_gpt_j.GPTJBlock: Layer, vllm_gpt_j.GPTJAttention: Attention, vllm_gpt_j.GPTJMLP: Mlp}
