"""What runs an Orbax checkpoint here: ``orbax.checkpoint`` itself for the load check (its ``PyTreeCheckpointer``
restores the item directory; above ``RESTORE_LIMIT`` bytes only its metadata of every array is read, and the check
says so); the model runs as its Hugging Face view's weights in transformers' class of its config (``--logits``,
``--generate``: ``converters.pytorch.weights``)."""

from __future__ import annotations


from ffn_tools.checks.load import LoadCheck

from ..pytorch.weights import TransformersRuns

RESTORE_LIMIT = 4 << 30


class OrbaxClient(TransformersRuns):
    """See the module docstring."""

    def __init__(self):
        super().__init__("orbax", "orbax.checkpoint", "", "Orbax", ("jax",), layouts=("hf", "maxtext"))

    def load_check(self, ckpt) -> LoadCheck:
        import orbax.checkpoint as ocp

        tree = ckpt.stored.tree
        try:
            if ckpt.stored.total_bytes <= RESTORE_LIMIT:
                restored = ocp.PyTreeCheckpointer().restore(str(tree.root.resolve()))
                leaves = _leaves(restored)
                ran = f"PyTreeCheckpointer.restore of all {len(leaves)} arrays"
            else:
                leaves = _leaves(ocp.PyTreeCheckpointer().metadata(str(tree.root.resolve())).item_metadata.tree)
                ran = (f"PyTreeCheckpointer.metadata of all {len(leaves)} arrays; not restored: above "
                       f"{RESTORE_LIMIT >> 30} GiB")
        except Exception as e:  # noqa: BLE001 - orbax's own refusal, reported as such
            return LoadCheck(self.label, refused=" ".join(str(e).split())[:300])
        missing = [".".join(k) for k in tree.paths if k not in leaves]
        if missing:
            return LoadCheck(self.label, missing=missing, architecture=ran)
        wrong = [f"{'.'.join(k)}: orbax {tuple(leaves[k])}, tensorstore {tree.shape_dtype(k)[0]}"
                 for k in tree.paths if tuple(leaves[k]) != tree.shape_dtype(k)[0]]
        return LoadCheck(self.label, mismatched=wrong, architecture=ran)


def _leaves(tree, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Key path -> shape of every array of a restored tree (or its metadata tree)."""
    if isinstance(tree, dict):
        out = {}
        for k, v in tree.items():
            out.update(_leaves(v, (*prefix, str(k))))
        return out
    shape = getattr(tree, "shape", None)
    return {prefix: tuple(shape)} if shape is not None else {}
