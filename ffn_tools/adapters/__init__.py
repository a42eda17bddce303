"""LoRA adapters of gated FFNs (and of anything else they target): read, re-laid out, converted, merged, verified.

    model      Lora (one target's factors, PyTorch orientation, its scale) and Adapter
    formats    the AdapterFormat interface and the table of formats (PEFT, mlx_lm, GGUF LoRA in converters/)
    places     which FFN projection a target is, from the registry's naming schemes
    relayout   exact fused <-> separate and stacked <-> per-expert re-layouts of factors
    conform    an adapter re-laid out to the base's own tensor names
    merge      base + scale·B·A, streamed
    verify     BASE+ADAPTER against MERGED, ADAPTER against ADAPTER2
    api        the commands as library functions
"""
