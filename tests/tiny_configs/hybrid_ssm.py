"""State-space and hybrid decoder families: the keys their tiny checkpoints need.

The scans are sized to the tiny hidden width (expand 2, 8 heads of 32, a 16-wide state). Where a family
mixes layer kinds, block 1 is the attention block and blocks 0 and 2 are mamba blocks (Nemotron-H: a mamba,
an attention and a sparse block; Zamba: a mamba block, then two hybrid blocks sharing one attention block's
weights; Falcon-H1 runs both in every block). Mixtures of experts have 4 experts, 2 per token; multipliers
are set away from 1 so a family that forgets one fails.
"""

from typing import Any

#: Mamba-2-style scans on the tiny width: 256 inner channels as 8 heads of 32, a 16-wide state.
SCAN = {"mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 1}
MAMBA_FIRST = ["mamba", "attention", "mamba"]
#: Zamba: a mamba block, then two hybrid blocks sharing one attention block's weights.
HYBRID_LAST = ["linear_attention", "hybrid", "hybrid"]

OVERRIDES: dict[str, dict[str, Any]] = {
    "mamba": {"state_size": 16},
    "falcon_mamba": {"state_size": 16},
    "mamba2": {"num_heads": 8, "head_dim": 32, "state_size": 16, "n_groups": 1, "chunk_size": 4},
    "jamba": {
        "intermediate_size": 64,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "attn_layer_period": 3,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "bamba": {**SCAN, "attn_layer_indices": [1], "mamba_chunk_size": 4},
    "granitemoehybrid": {
        **SCAN,
        "layer_types": MAMBA_FIRST,
        "mamba_chunk_size": 4,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "shared_intermediate_size": 128,
        "position_embedding_type": "rope",
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 4.0,
    },
    "falcon_h1": {
        **SCAN,
        "mamba_d_ssm": 256,
        "mamba_chunk_size": 4,
        "lm_head_multiplier": 0.5,
        "embedding_multiplier": 2.0,
        "mlp_multipliers": [0.5, 2.0],
        "key_multiplier": 0.5,
        "attention_in_multiplier": 2.0,
        "attention_out_multiplier": 0.5,
        "ssm_multipliers": [0.5, 2.0, 0.5, 2.0, 0.5],
        "ssm_in_multiplier": 2.0,
        "ssm_out_multiplier": 0.5,
    },
    "nemotron_h": {
        "layers_block_type": ["linear_attention", "full_attention", "moe"],
        "intermediate_size": 256,
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "ssm_state_size": 16,
        "n_groups": 1,
        "chunk_size": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "moe_shared_expert_intermediate_size": 64,
        "routed_scaling_factor": 2.0,
    },
    "zamba": {
        "layers_block_type": HYBRID_LAST,
        "n_mamba_heads": 2,
    },
    "zamba2": {
        "layers_block_type": HYBRID_LAST,
        "n_mamba_heads": 8,
        "mamba_d_state": 16,
        "chunk_size": 4,
        # the adapters project to the attention width (2 * hidden_size) for queries, keys and values alike
        "head_dim": 64,
        "num_key_value_heads": 4,
        "use_shared_attention_adapter": True,
        "adapter_rank": 8,
        "use_mem_rope": True,
    },
}
