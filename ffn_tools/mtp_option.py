"""The ``--mtp`` option (``ffn_tools.mtp``) and the metadata key its record is written under, declared once: what
the formats that take it (torch, MLX, GGUF) import at their package's import, without the heads' layouts and
readers (a GGUF tensor writer's child imports the GGUF package, and no more)."""

from __future__ import annotations

from .formats import Option

RECORD = "ffn_tools_mtp"  # safetensors metadata key: what ``--mtp`` did to the heads ({"mtp": "drop", ...})
MODES = ("keep", "drop", "only")
OPTION = Option("mtp", "What to do with the model's multi-token-prediction (MTP, NextN) heads (DeepSeek-V3's and "
                "GLM-4.5's blocks past num_hidden_layers, Qwen3-Next's mtp.*): keep (the default: written as the "
                "source names them), drop (left out, and recorded in the output's metadata so verify knows it was "
                "on purpose), only (the heads alone, a draft model's weights). Every conversion says what it did "
                "with them.", choices=MODES)
