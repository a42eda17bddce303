"""``--upload-repo``: push what a command wrote to a Hugging Face Hub repo, as ``mlx_lm.convert --upload-repo``.

The output is written (atomically, as always) first and uploaded after, with ``huggingface_hub`` (its token,
HF_TOKEN and HF_ENDPOINT apply): the repo is created if missing, then one commit adds the directory (or a
single-file output and the manifest beside it). If the upload fails the output stays where it was written
and the error says how to upload it by hand.
"""

from __future__ import annotations

from pathlib import Path

from .errors import FFNToolsError
from .hub import REPO_ID


def check_repo_id(repo_id: str | None) -> None:
    """Refuse a malformed repo id before anything is written.

    Raises:
        FFNToolsError: not ``org/name``.
    """
    if repo_id is not None and (not REPO_ID.fullmatch(repo_id) or "@" in repo_id):
        raise FFNToolsError(f"--upload-repo {repo_id!r}: a Hub repo id is org/name (no revision)")


def upload(out: Path, repo_id: str, command: str) -> str:
    """Upload ``out`` to the model repo ``repo_id``; returns the repo's URL.

    Raises:
        FFNToolsError: huggingface_hub missing, or the Hub refused (the output stays, the message says so).
    """
    check_repo_id(repo_id)
    try:
        from huggingface_hub import HfApi
    except ImportError:
        raise FFNToolsError(f"{out} was written; --upload-repo needs huggingface_hub: pip install huggingface_hub"
                            ) from None
    out = Path(out)
    api = HfApi()
    message = f"Upload {out.name} (ffn-tools {command})"
    try:
        url = api.create_repo(repo_id, exist_ok=True)
        if out.is_dir():
            api.upload_folder(folder_path=str(out), repo_id=repo_id, commit_message=message)
        else:
            from huggingface_hub import CommitOperationAdd

            files = [out] + [p for p in (out.with_suffix(".json"),) if p.is_file() and p != out]
            api.create_commit(repo_id, [CommitOperationAdd(p.name, str(p)) for p in files], commit_message=message)
    except Exception as e:  # noqa: BLE001 - the hub client's errors: auth, network, refused
        reason = " ".join(str(e).split())[:240]
        raise FFNToolsError(f"{out} was written, but uploading it to {repo_id} failed ({type(e).__name__}: "
                            f"{reason}); it stays there: upload it with `hf upload {repo_id} {out}`") from None
    return str(url)
