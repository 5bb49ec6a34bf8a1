"""Validation of the data section: sources, split, datasets on disk, tokenizer vs model and data.

:func:`check_data` checks where the data comes from (a built-in corpus, prefixes with weights,
or a JSON data config whose blends name existing datasets) and the split; :func:`check_tokenizer`
loads the tokenizer and checks it against ``model.vocab_size`` and the tokenizer each dataset
records. Both append one line per problem to ``problems`` (see :mod:`.validate`); file contents
are checked later, by the preflight (:mod:`shardwork.trainer.run.preflight`).
"""

from __future__ import annotations

from pathlib import Path

from shardwork.trainer.config.sections import DataConfig, TrainConfig
from shardwork.trainer.data.builder import read_data_config
from shardwork.trainer.data.corpus import BUILTIN_CORPORA
from shardwork.trainer.data.dataset_meta import DatasetMeta, read_dataset_meta
from shardwork.trainer.data.indexed import data_file_paths, dataset_exists
from shardwork.trainer.data.tokenizer import Tokenizer, load_tokenizer


def _missing_files(prefix: str) -> str:
    """The files of dataset ``prefix`` that are not there, and how to make them."""
    missing = " and ".join(str(f) for f in data_file_paths(prefix) if not f.is_file())
    return f"{missing} (build the dataset with shardwork-preprocess --output PREFIX)"


def check_data(config: TrainConfig, problems: list[str]) -> None:
    d = config.data
    if not isinstance(d.seq_length, int) or isinstance(d.seq_length, bool) or d.seq_length < 1:
        problems.append(f"data.seq_length={d.seq_length!r}: must be an integer >= 1")
    sources = [bool(d.prefixes), d.data_config is not None]
    if sum(sources) > 1:
        problems.append("data.prefixes and data.data_config are both set: give only one")
    if not any(sources):
        if d.corpus is None:
            problems.append(
                'data: no data: set data.corpus="pydoc", data.prefixes or data.data_config'
            )
        elif d.corpus not in BUILTIN_CORPORA:
            problems.append(
                f"data.corpus={d.corpus!r}: not built in; valid: {list(BUILTIN_CORPORA)}"
            )
    if d.weights and len(d.weights) != len(d.prefixes):
        problems.append(
            f"data.weights has {len(d.weights)} entries but data.prefixes has {len(d.prefixes)}: "
            "give one weight per prefix (or none for equal weights)"
        )
    if d.weights and (any(w < 0 for w in d.weights) or sum(d.weights) <= 0):
        problems.append(f"data.weights={d.weights}: must be >= 0 with a positive sum")
    for prefix in d.prefixes:
        if not dataset_exists(prefix):
            problems.append(f"data.prefixes: {prefix!r} has no {_missing_files(prefix)}")
    if d.data_config is not None:
        try:
            blends = read_data_config(d.data_config)
        except ValueError as exc:
            problems.append(f"data.data_config={d.data_config!r}: {exc}")
            blends = {}
        for split, blend in blends.items():
            for _, prefix in blend:
                if not dataset_exists(prefix):
                    problems.append(
                        f"data.data_config={d.data_config!r}: the {split!r} blend names {prefix!r}"
                        f", which has no {_missing_files(prefix)}"
                    )
    try:
        parts = [float(x) for x in d.split.split(",")]
        if len(parts) != 3 or any(x < 0 for x in parts) or parts[0] <= 0:
            raise ValueError
    except ValueError:
        problems.append(
            f"data.split={d.split!r}: must be three non-negative numbers 'train,valid,test' "
            "with train > 0 (e.g. '90,10,0')"
        )
    else:
        eval_wanted = config.eval.interval is not None or config.eval.at_end
        if eval_wanted and parts[1] == 0 and d.data_config is None:
            problems.append(
                f"data.split={d.split!r} has no validation part but evaluation is on: give it one "
                "or set eval.interval='none' and eval.at_end=false"
            )
    if d.tokenizer == "byte" and d.eod_token is not None:
        problems.append(
            f"data.eod_token={d.eod_token!r} names a token of a tokenizer file, but "
            "data.tokenizer='byte' has a fixed end-of-document id (256); valid: leave "
            'data.eod_token unset ("none"), or give data.tokenizer a tokenizer JSON file'
        )
    if d.tokenizer != "byte" and not Path(d.tokenizer).expanduser().is_file():
        problems.append(
            f"data.tokenizer={d.tokenizer!r}: must be 'byte' or an existing tokenizer JSON file"
        )


def check_tokenizer(config: TrainConfig, problems: list[str]) -> bool:
    """Load the tokenizer and check the vocabulary against the model and the datasets.

    Returns False when the tokenizer itself cannot be loaded (later checks need it)."""
    d = config.data
    try:
        tokenizer = load_tokenizer(d.tokenizer, eod_token=d.eod_token)
    except (ImportError, ValueError) as exc:
        problems.append(
            f"data.tokenizer={d.tokenizer!r}: {exc}; valid: 'byte' or a tokenizer.json "
            "written by the `tokenizers` library"
        )
        return False
    vocab = config.model.settings.get("vocab_size")
    if vocab is not None and vocab < tokenizer.vocab_size:
        problems.append(
            f"model.vocab_size={vocab} is smaller than the vocabulary of data.tokenizer="
            f"{d.tokenizer!r} ({tokenizer.vocab_size} ids): the embedding could not look up the "
            f"larger ids; valid: >= {tokenizer.vocab_size} (or leave it unset to use the "
            f"tokenizer's)"
        )
    _check_dataset_tokenizers(d, tokenizer, problems)
    return True


def _check_dataset_tokenizers(d: DataConfig, tokenizer: Tokenizer, problems: list[str]) -> None:
    """Each dataset of ``d`` (``config.data``) that records its tokenizer (``.meta.json``) must
    have been built with ``tokenizer``'s vocabulary and end-of-document id."""
    datasets = [(f"data.prefixes[{i}]", prefix) for i, prefix in enumerate(d.prefixes or [])]
    if d.data_config is not None:
        try:
            blends = read_data_config(d.data_config)
        except ValueError:  # reported by check_data
            blends = {}
        for split, entries in blends.items():
            datasets += [(f"data.data_config[{split!r}]", prefix) for _, prefix in entries]
    recorded = [(w, p, m) for w, p in datasets if (m := read_dataset_meta(p)) is not None]
    # end-of-document ids of the datasets this vocabulary could read: more than one, and no
    # data.eod_token suits them all
    eod_ids = {m.eod_id for _, _, m in recorded if m.vocab_size == tokenizer.vocab_size}
    for where, prefix, meta in recorded:
        if (meta.vocab_size, meta.eod_id) != (tokenizer.vocab_size, tokenizer.eod_id):
            built = (
                f"{where}={prefix!r} was tokenized with {meta.tokenizer!r} (vocab "
                f"{meta.vocab_size}, end-of-document id {meta.eod_id}) but data.tokenizer="
                f"{d.tokenizer!r} has vocab {tokenizer.vocab_size}, end-of-document id "
                f"{tokenizer.eod_id}"
            )
            problems.append(f"{built}{_dataset_tokenizer_remedy(d, tokenizer, meta, eod_ids)}")


def _dataset_tokenizer_remedy(
    d: DataConfig, tokenizer: Tokenizer, meta: DatasetMeta, eod_ids: set[int]
) -> str:
    """How to train on a dataset built with ``meta``'s vocabulary and end-of-document id, which
    ``tokenizer`` (``data.tokenizer`` with ``data.eod_token``) does not match: with the same
    vocabulary, the ``data.eod_token`` naming the dataset's id; when the run's datasets (their
    ``eod_ids``) mix ids, which no one ``data.eod_token`` suits, re-tokenizing; else the
    tokenizer the dataset was built with."""
    token = tokenizer.token_of(meta.eod_id) if meta.vocab_size == tokenizer.vocab_size else None
    if token is None:
        return "; valid: the tokenizer the dataset was built with"
    ours = tokenizer.token_of(tokenizer.eod_id)
    setting = f"data.eod_token={d.eod_token!r}" + ("" if d.eod_token else f" (picks {ours!r})")
    ends = f"it ends documents with {token!r} (id {meta.eod_id}), and {setting} does not"
    if len(eod_ids) > 1:
        return (
            f": {ends}; the run's datasets mix end-of-document ids {sorted(eod_ids)}, and one "
            f"data.eod_token serves one of them; valid: re-tokenize it with shardwork-preprocess "
            f"--eod_token {ours!r}, or leave it out"
        )
    return f": {ends}; valid: data.eod_token={token!r}"
