"""Tiny configs of the classic decoder-only families (GPT-Neo, CodeGen, Falcon, MPT, ...): their own size spellings."""

from typing import Any

OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt_bigcode": {"n_inner": 256},
    "gpt_neo": {"attention_types": [[["global", "local"], 1], [["global"], 1]], "window_size": 4},
    "codegen": {"n_inner": 256, "rotary_dim": 16},
    "phi": {},
    "persimmon": {},
    "falcon": {"ffn_hidden_size": 256},
    "mpt": {"max_seq_len": 256},
    "biogpt": {},
    "xglm": {"ffn_dim": 256},
    "ctrl": {"dff": 256},
    "gpt_neox_japanese": {"intermediate_multiple_size": 2},
    "bitnet": {},
}
