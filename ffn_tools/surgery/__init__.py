"""Expert surgery (issue #56): ``prune-experts``, ``reorder-experts`` and ``saliency``.

A MoE checkpoint's routed experts kept, dropped or reordered per layer, as a plan of pure byte moves run by the
one executor (``executor.execute``): a per-expert tensor renamed to its new index, a stacked one (transformers
v5 ``experts.gate_up_proj``/``down_proj``, a flat stack) cut into its experts, those kept taken in order and
stacked again (``Unstack``, ``Take``, ``Stack``), the router's rows (``gate.weight``, ``e_score_correction_bias``,
router biases) the same way, in step. Shared experts, dense layers and every other tensor are copied. The
config's expert count is updated (every key of ``routers.EXPERT_COUNT_KEYS`` present), ``num_experts_per_tok``
checked against it, and the mapping new index -> source index recorded in the output (``mapping``): the weight
files' metadata, ``expert_map.json`` beside them, and the receipt's command.

Modules: ``selection`` (--keep/--drop/--order read per layer), ``layers`` (each MoE layer's experts, their
tensors and its router, found from the scheme's names), ``routers`` (router tensor names and config keys, as
data), ``planning`` (the plan and the config), ``mapping`` (the recorded mapping, read back by verify's
``verification.expert_map``), ``run`` (the commands' library functions), ``gguf`` (a GGUF input: its
``_exps`` stacks' expert slabs and router rows sliced as stored bytes, any quant type), ``saliency`` (each
expert's REAP score and routing frequency on prompts, which ``prune-experts --saliency`` ranks by, summed by the
checkpoint's own client: ``Client.expert_saliency``).

Proven by ``verify A B``: B's experts paired with their sources through the mapping, the routers' rows in step,
and with ``--logits`` B against A run with the experts B dropped masked out of its routing (``expert_map.masking``,
``Client.masked_logits``: transformers and mlx_lm), each layer's routing mass lost reported.
"""
