"""Write a Megatron indexed dataset (PREFIX.bin / PREFIX.idx) from text files, byte-level.

Megatron-LM's ``tools/preprocess_data.py`` is not part of the megatron-core wheel, and its
tokenizers need vocabulary files. This script needs neither: every UTF-8 byte is a token
(0-255) and each file (one document) ends with the end-of-document token 256. Train on the
result with the tokenizer that matches it::

    --tokenizer-type NullTokenizer --null-tokenizer-eod-id 256 --vocab-size V   # V >= 257

Default input: the ``.py`` sources of the running Python's standard library (no tests), in
sorted path order, i.e. real text that every machine with Python has. The same Python version
gives the same bytes; ``PREFIX.json`` records the version, the file count and a SHA-256 of the
data so runs on different machines can be compared.

Usage::

    python examples/make_indexed_dataset.py --output-prefix .data/pystdlib_bytes \\
        --max-bytes 12000000
    python examples/make_indexed_dataset.py --output-prefix .data/mytext --input a.txt b/
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

logger = logging.getLogger("make_indexed_dataset")

EOD_TOKEN = 256
"""End-of-document token id; pass it as ``--null-tokenizer-eod-id``."""
MIN_VOCAB_SIZE = EOD_TOKEN + 1

# Standard-library folders that are mostly test data or generated tables, not prose or code.
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "encodings"}


def stdlib_sources() -> list[Path]:
    """The ``.py`` files of the running Python's standard library, sorted, tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)


def expand_inputs(inputs: Iterable[str]) -> list[Path]:
    """Files named, plus the files under folders named (sorted, hidden ones skipped)."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            files.extend(
                p for p in sorted(path.rglob("*")) if p.is_file() and not p.name.startswith(".")
            )
        else:
            files.append(path)
    return files


def byte_documents(files: Iterable[Path], max_bytes: int) -> Iterator[np.ndarray]:
    """One token array per non-empty file (bytes + EOD) until ``max_bytes`` of text are used.

    The file that crosses the limit is cut at it, so the total text is exactly
    ``min(max_bytes, available)`` bytes.
    """
    used = 0
    for path in files:
        if used >= max_bytes:
            return
        data = path.read_bytes()[: max_bytes - used]
        if not data:
            continue
        used += len(data)
        tokens = np.empty(len(data) + 1, dtype=np.uint16)
        tokens[:-1] = np.frombuffer(data, dtype=np.uint8)
        tokens[-1] = EOD_TOKEN
        yield tokens


def write_indexed_dataset(documents: Iterable[np.ndarray], output_prefix: str) -> dict:
    """Write ``output_prefix.bin/.idx`` with megatron-core's ``IndexedDatasetBuilder``.

    Returns:
        Summary: documents, tokens, dtype, SHA-256 of the ``.bin`` file.
    """
    from megatron.core.datasets.indexed_dataset import (
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=np.uint16)
    num_docs = num_tokens = 0
    for tokens in documents:
        # A numpy array is accepted as is (the builder converts with numpy.array(..., dtype)).
        builder.add_document(tokens, [len(tokens)])
        num_docs += 1
        num_tokens += len(tokens)
    builder.finalize(get_idx_path(output_prefix))
    digest = hashlib.sha256(Path(get_bin_path(output_prefix)).read_bytes()).hexdigest()
    return {"documents": num_docs, "tokens": num_tokens, "dtype": "uint16", "bin_sha256": digest}


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-prefix", required=True, help="Writes PREFIX.bin/.idx/.json")
    parser.add_argument(
        "--input",
        nargs="*",
        default=None,
        help="Text files or folders (default: the Python standard library's .py sources)",
    )
    parser.add_argument(
        "--max-bytes", type=int, default=12_000_000, help="Stop after this much text (bytes)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    files = expand_inputs(args.input) if args.input else stdlib_sources()
    if not files:
        parser.error("no input files")
    summary = write_indexed_dataset(byte_documents(files, args.max_bytes), args.output_prefix)
    summary.update(
        source="python-stdlib" if not args.input else "files",
        python=sys.version.split()[0],
        files_available=len(files),
        max_bytes=args.max_bytes,
        eod_token=EOD_TOKEN,
        tokenizer_flags=(
            f"--tokenizer-type NullTokenizer --null-tokenizer-eod-id {EOD_TOKEN} "
            f"--vocab-size V (V >= {MIN_VOCAB_SIZE})"
        ),
    )
    Path(args.output_prefix + ".json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.info(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
