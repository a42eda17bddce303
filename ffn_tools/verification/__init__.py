"""``ffn-tools verify``: prove that checkpoint B holds the same FFNs (and everything else) as checkpoint A.

    engine      ``verify``: open both sides, run the checks in phases, build the report
    options     what verify was asked, as one value (``VerifyOptions``); both sides as whole models
    expected    what B should hold given A, as B's client will hold it: derived once, compared once
    sides       what each side holds: its FFNs, its description, the selection compared
    pairrun     the FFN pairs run: here, or as Ray tasks; resumed; their results into the report
    steps       the FFN pairs as steps: experts batched, the first of each kind alone, tolerance rows
    pairs       one FFN pair: exact weights, re-derived codes, functional runs on every backend
    kept        a side that says it holds the other's stored codes: their values, exactly
    experts     a layer's routed experts checked in batches
    functional  seeded inputs, the float64 reference, kernel dtypes
    backends    the kernel backends asked for, or every one available here
    outside     every tensor outside the FFNs, accounted for
    quant       quantization of a side and its tolerance row
    model       what is not weights, asked of B's client; whole-model logits through both clients
    logits      the logits comparison
    stream      reading the next steps' tensors while the current ones run
    partial     ``--layers`` on a machine holding only some shards
    tied        a tied head stored on one side only (one of ``expected``'s transforms)
    report      the report: table, verdict, JSON

It names no format: what a format's runtime does (load check, config, tokenizer, logits, the transforms of its
load) is asked of that side's client (``ffn_tools.clients``), and quantized tensors of their scheme
(``ffn_tools.quant``). (``ffn_tools.verify`` is the Python API's function, so this package is named for the
activity.)
"""
