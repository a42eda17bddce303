"""``ffn-tools verify``: prove that checkpoint B holds the same FFNs (and everything else) as checkpoint A.

    engine      ``verify``: pair FFNs, run the checks, build the report
    pairs       one FFN pair: exact weights, functional runs on every backend
    functional  seeded inputs, the float64 reference, kernel dtypes
    outside     every tensor outside the FFNs, accounted for
    quant       quantization of a side (MLX) and its tolerance row
    requant     a quantized MLX tensor of B against A's re-quantized with B's parameters, bit for bit
    logits      whole models through their real clients (transformers, mlx_lm)
    diagnose    what a mismatch looks like (gate/up swapped, another layout)
    report      the report: table, verdict, JSON
    cli         the ``verify`` command

(``ffn_tools.verify`` is the Python API's function, so this package is named for the activity.)
"""
