"""The on-disk layout of a target-feature capture (``vat prep capture``) and its reader (``data.capture``).

A capture directory holds, per sample of a prepared dataset, what training reads from the frozen target: the aux
hidden states the drafter reads, the last decoder layer's output (the final norm's input: the trainer recomputes the
logits through the target's final norm and LM head) and the executed top-k expert ids of every MoE layer::

    DIR/manifest.json            what was captured, from which target and data, and which shards are complete
    DIR/shard_00000.safetensors  contiguous dataset rows; per row r: aux.r (T, n_aux*H), last.r (T, H),
                                 routing.r (T, L', k) and input_ids.r (T,) int32

The manifest is rewritten (atomically) after each shard, so a rerun continues after the last complete shard.
docs/data.md ("Captured target features") describes every field.

:class:`CaptureReader` also reads speculators' data-generation output as a capture without routing: a directory
whose ``hidden_states/`` (or itself) holds ``hs_{i}.safetensors`` per dataset row i, each with ``token_ids`` (T,) and
``hidden_states`` (T, n_aux + 1, H): the aux layers in the order vLLM captured them, then the last hidden state after
the final norm (speculators feeds it to the LM head as is).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors import safe_open

from vat.errors import VatError

MANIFEST = "manifest.json"
FORMAT = "vat-capture/1"
OPEN_SHARDS = 8  # shard files kept open by a reader (each is memory-mapped; a batch touches a few)
# the target facts a capture records and a training run must match (target.path's own, read from its config)
IDENTITY_KEYS = ("model_type", "hidden_size", "vocab_size", "num_layers")
SPECULATORS_SUBDIR = "hidden_states"  # where speculators' data generation writes hs_{i}.safetensors


def shard_name(index: int) -> str:
    """The file name of shard ``index``."""
    return f"shard_{index:05d}.safetensors"


def plan_shards(lengths: list[int], shard_tokens: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` ranges over the captured rows, each closed once it holds ``shard_tokens`` tokens
    (a deterministic function of the lengths: a rerun plans the same shards and continues after the last one done)."""
    ranges, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        tokens += n
        if tokens >= shard_tokens:
            ranges.append((start, i + 1))
            start, tokens = i + 1, 0
    if start < len(lengths):
        ranges.append((start, len(lengths)))
    return ranges


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids ``0 .. num_experts - 1``."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 32767 else torch.int32


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` atomically (a kill leaves the previous one)."""
    path = os.path.join(directory, MANIFEST)
    tmp = f"{path}.{os.getpid()}.tmp"  # one per process: parts of one capture may write at once
    with open(tmp, "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(tmp, path)


def speculators_manifest(directory: str) -> dict[str, Any] | None:
    """A manifest for speculators' ``hs_{i}.safetensors`` files under ``directory`` (None when there are none):
    routing absent, the last hidden state already normed, the target known only by its hidden size."""
    folder = os.path.join(directory, SPECULATORS_SUBDIR)
    folder = folder if os.path.isdir(folder) else directory
    files = {int(name[3:-12]): os.path.relpath(os.path.join(folder, name), directory) for name in os.listdir(folder)
             if name.startswith("hs_") and name.endswith(".safetensors") and name[3:-12].isdigit()}
    if not files:
        return None
    first = os.path.join(directory, files[min(files)])
    try:
        with safe_open(first, framework="pt", device="cpu") as f:
            layers = f.get_slice("hidden_states")
            (_, stacked, hidden), dtype = layers.get_shape(), layers.get_dtype()
    except Exception as err:
        raise VatError(f"cannot read {first} as speculators hidden states: {str(err).splitlines()[0]}") from None
    rows = sorted(files)
    return {"format": FORMAT, "complete": True, "source": "speculators", "routing": False, "dtype": dtype,
            "target": {"hidden_size": int(hidden), "aux_layer_ids": None, "num_aux": int(stacked) - 1, "last": "normed"},
            "rows": rows, "files": {str(r): files[r] for r in rows}, "shards": []}


def load_manifest(directory: str) -> dict[str, Any]:
    """A capture's manifest: vat's ``manifest.json``, else one for speculators' files (:func:`speculators_manifest`)."""
    if os.path.isdir(directory) and not os.path.exists(os.path.join(directory, MANIFEST)):
        manifest = speculators_manifest(directory)
        if manifest is not None:
            return manifest
    return read_manifest(directory)


def read_manifest(directory: str) -> dict[str, Any]:
    """The manifest of a capture directory; a missing directory or manifest, or another format, in one line."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise VatError(f"capture directory not found: {directory} (make one with `vat prep capture`)")
    if not os.path.exists(path):
        raise VatError(f"{directory} has no {MANIFEST}: not a capture (make one with `vat prep capture`)")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise VatError(f"cannot read {path}: {str(err).splitlines()[0]}") from None
    if manifest.get("format") != FORMAT:
        raise VatError(f"{path} is format `{manifest.get('format')}`, this vat reads `{FORMAT}`")
    return manifest


class CaptureReader:
    """Reads a complete capture's per-row features into padded batches.

    Args:
        directory: a ``vat prep capture`` output.

    Raises:
        VatError: an unfinished capture or a missing shard file (before anything trains).
    """

    def __init__(self, directory: str):
        self.directory = directory
        self.manifest = load_manifest(directory)
        if not self.manifest.get("complete"):
            done = self.manifest["shards"][-1]["end"] if self.manifest["shards"] else 0
            raise VatError(f"capture {directory} is unfinished ({done} of {len(self.manifest['rows'])} rows): rerun "
                           "the same `vat prep capture` command to complete it")
        self.speculators = self.manifest.get("source") == "speculators"
        self.file_of: dict[int, str] = {int(r): f for r, f in self.manifest.get("files", {}).items()}  # row -> file
        for shard in self.manifest["shards"]:
            if not os.path.exists(os.path.join(directory, shard["file"])):
                raise VatError(f"capture {directory}: shard {shard['file']} (rows {shard['start']}-{shard['end'] - 1} "
                               "of the capture) is missing; rerun `vat prep capture` into the directory to redo it")
            for row in self.manifest["rows"][shard["start"]:shard["end"]]:
                self.file_of[row] = shard["file"]
        self.has_routing = bool(self.manifest.get("routing", True))
        self.target = self.manifest["target"]
        self._open: dict[str, Any] = {}

    def missing(self, rows: list[int]) -> list[int]:
        """The dataset rows of ``rows`` the capture does not hold."""
        return [r for r in rows if r not in self.file_of]

    def _file(self, name: str):
        if name not in self._open:
            if len(self._open) >= OPEN_SHARDS:
                self._open.pop(next(iter(self._open)))
            path = os.path.join(self.directory, name)
            try:
                self._open[name] = safe_open(path, framework="pt", device="cpu")
            except Exception as err:  # a shard deleted or truncated after the check
                raise VatError(f"cannot read capture file {path}: {str(err).splitlines()[0]}") from None
        return self._open[name]

    def sample(self, row: int) -> dict[str, torch.Tensor]:
        """One row's tensors: ``aux`` (T, n_aux*H), ``last`` (T, H), ``input_ids`` (T,), ``routing`` (T, L', k)."""
        handle = self._file(self.file_of[row])
        if self.speculators:
            stacked = handle.get_tensor("hidden_states")  # (T, n_aux + 1, H)
            return {"aux": stacked[:, :-1].flatten(1), "last": stacked[:, -1], "input_ids": handle.get_tensor("token_ids")}
        names = ("aux", "last", "input_ids") + (("routing",) if self.has_routing else ())
        return {name: handle.get_tensor(f"{name}.{row}") for name in names}

    def batch(self, rows: list[int], input_ids: torch.Tensor, pad_expert: int) -> dict[str, torch.Tensor | None]:
        """The features of dataset rows ``rows`` right-padded to ``input_ids``' length, checked against its tokens.

        Args:
            rows: dataset row of each batch row.
            input_ids: (B, T) the collated batch (on any device); row b's first ``len`` tokens must be the captured ones.
            pad_expert: the expert id written at padded positions (``num_experts``: a dropped slot, no expert).

        Returns:
            ``aux`` (B, T, n_aux*H), ``last`` (B, T, H) in the capture's dtype, ``routing`` (L', B, T, k) int64 or
            None (a capture without routing), all on CPU.
        """
        samples = [self.sample(row) for row in rows]
        batch, length = input_ids.shape
        ids_cpu = input_ids.cpu()
        first = samples[0]
        aux = first["aux"].new_zeros(batch, length, first["aux"].shape[-1])  # (B, T, n_aux*H)
        last = first["last"].new_zeros(batch, length, first["last"].shape[-1])  # (B, T, H)
        routing = None
        if self.has_routing:
            _, layers, k = first["routing"].shape
            routing = torch.full((layers, batch, length, k), pad_expert, dtype=torch.long)  # (L', B, T, k)
        for b, (row, s) in enumerate(zip(rows, samples)):
            n = s["input_ids"].shape[0]
            if n > length or not torch.equal(s["input_ids"].long(), ids_cpu[b, :n]):
                raise VatError(f"capture {self.directory} row {row} holds other tokens than the training data's row "
                               f"{row}: capture the data set the run trains on (data.train)")
            aux[b, :n], last[b, :n] = s["aux"], s["last"]
            if routing is not None:
                routing[:, b, :n] = s["routing"].long().transpose(0, 1)  # (T, L', k) -> (L', T, k)
        return {"aux": aux, "last": last, "routing": routing}
