"""Phi-4-multimodal (``Phi4MultimodalForCausalLM``): Phi-3 blocks on the llama layout, image and audio embeddings aside.

The text model sits at the top (fused ``qkv_proj`` and ``gate_up_proj`` as in Phi-3); the image and
audio encoders under ``model.embed_tokens_extend`` replace only the embeddings of their placeholder
tokens, so a text prompt's residual stream starts at ``embed_tokens``.
"""

from transformers.models.phi4_multimodal import modeling_phi4_multimodal as hf

from ._layouts import LLAMA_RENAME, classes

RENAME = LLAMA_RENAME

Layer, Attention, Mlp = classes(__name__)
ENVOYS = {hf.Phi4MultimodalDecoderLayer: Layer, hf.Phi4MultimodalAttention: Attention, hf.Phi4MultimodalMLP: Mlp}
