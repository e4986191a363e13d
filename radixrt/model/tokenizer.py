"""`load_tokenizer`: a transformers tokenizer for an HF directory or a GGUF file.

Converting a GGUF vocabulary takes seconds, so the converted tokenizer is saved once under
`$RADIXRT_CACHE_DIR/tokenizers/<key>` (default `~/.cache/radixrt/tokenizers/<key>`), where `key`
hashes the file's absolute path, size, mtime and the transformers version. A cache entry appears
atomically (written to a temporary directory, then renamed), so racing processes never read a
partial one; the loser of a rename race discards its copy and uses the winner's.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from radixrt.model.model_config import gguf_cache_path, resolve_gguf_file

logger = logging.getLogger(__name__)


def load_tokenizer(
    model_path: str | os.PathLike[str], tokenizer_path: str | os.PathLike[str] | None = None
) -> Any:
    """The tokenizer at `tokenizer_path` if given, else the one of `model_path` (dir or .gguf)."""
    from transformers import AutoTokenizer

    path = Path(tokenizer_path if tokenizer_path is not None else model_path)
    gguf_file = resolve_gguf_file(path)
    if gguf_file is None:
        return AutoTokenizer.from_pretrained(str(path))
    return _load_gguf_tokenizer_cached(gguf_file)


def _load_gguf_tokenizer_cached(gguf_file: Path) -> Any:
    from transformers import AutoTokenizer

    final = gguf_cache_path(gguf_file, "tokenizers")
    if final.is_dir():
        try:
            return AutoTokenizer.from_pretrained(str(final))
        except Exception as e:  # a damaged entry: rebuild it below
            logger.warning("tokenizer cache %s unreadable (%s); rebuilding", final, e)
            shutil.rmtree(final, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            tok.save_pretrained(str(tmp))
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Another process published the entry first: keep theirs.
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # read-only home, full disk, ...: serve uncached
        logger.warning("could not cache the GGUF tokenizer under %s: %s", final, e)
    return tok
