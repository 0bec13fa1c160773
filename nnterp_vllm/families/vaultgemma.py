"""VaultGemma (``VaultGemmaForCausalLM``): the llama layout (no post-sublayer norms) with soft-capped logits."""

from transformers.models.vaultgemma import modeling_vaultgemma as hf

from ._layouts import LLAMA_RENAME, classes, softcap

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.VaultGemmaDecoderLayer: Layer, hf.VaultGemmaAttention: Attention, hf.VaultGemmaMLP: Mlp}
post_head = softcap
