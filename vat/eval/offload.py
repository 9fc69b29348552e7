"""Expert offloading: which expert weights a decode moves from host memory to the GPU, and what that costs.

A target too large for GPU memory keeps C routed experts per MoE layer resident on the GPU and the rest in host
memory; a forward that executes a non-resident expert first copies its weights over the host link (host-to-device,
H2D). This module replays the experts each target forward of a decode executed (the engine's
``RoundStats.expert_sets``, recorded with ``record_experts``) through one residency cache per layer, in order, and
prices the copies (docs/eval.md "Expert offloading"):

* a forward's **misses** in layer l are the experts it executed that were not resident when it started; each is
  one expert's weights, e_l · served bytes, over the link (H2D bytes);
* the modeled time of a forward under offload is the cost model's (:mod:`vat.eval.cost`) plus H2D bytes / link
  bandwidth (fetches are on demand and not overlapped with compute);
* the autoregressive baseline of a decode is the same tokens generated one at a time (as the cost model prices it):
  one forward per kept token, executing the experts that token's position executed in the verification forward
  (``RoundStats.input_experts``), replayed through its own caches.

The caches start warm: a miss while a layer holds fewer than C experts fills a free slot without charge (the loads a
server made before this request), so C = E moves nothing and the modeled speed-up under offload is the cost model's.
The caches live for one pass (one draft x budget over one benchmark, its prompts in order), as a server's would.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vat.errors import VatError

RESIDENCY_POLICIES = ("lru", "lfu")  # eviction: least recently used | least frequently used (ties: least recent)


@dataclass(frozen=True)
class HostLink:
    """The host-to-device link the non-resident experts cross.

    Attributes:
        name: the ``offload_link`` key.
        label: a readable name.
        bytes_per_s: bandwidth in one direction (host to device), bytes/s.
        source: where the figure comes from.
    """

    name: str
    label: str
    bytes_per_s: float
    source: str


HOST_LINKS: dict[str, HostLink] = {
    # PCI-SIG PCIe 5.0: 32 GT/s per lane, 128b/130b encoding: 16 lanes = 63 GB/s per direction; NVIDIA's H100 PCIe
    # data sheet quotes 128 GB/s for PCIe Gen5 (both directions)
    "pcie5": HostLink("pcie5", "PCIe 5.0 x16", 64e9,
                      "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b = 63 GB/s per direction (NVIDIA: 128 GB/s both)"),
    # NVIDIA GH200 Grace Hopper Superchip data sheet: NVLink-C2C 900 GB/s CPU <-> GPU, both directions together
    "c2c": HostLink("c2c", "NVLink-C2C (GH200)", 450e9,
                    "NVIDIA GH200 data sheet: NVLink-C2C 900 GB/s bidirectional = 450 GB/s per direction"),
}


@dataclass(frozen=True)
class OffloadSpec:
    """What the offload model runs: the cache sizes, the eviction policy and the host link.

    Attributes:
        capacities: C, resident experts per MoE layer, one modeled cache per entry (ascending, distinct).
        policy: one of :data:`RESIDENCY_POLICIES`.
        link: a :data:`HOST_LINKS` key.
    """

    capacities: tuple[int, ...]
    policy: str = "lru"
    link: str = "pcie5"

    @classmethod
    def parse(cls, capacities: str | int | Sequence[int], policy: str = "lru", link: str = "pcie5") -> OffloadSpec:
        """``"8,12"`` (or a list of ints) with a policy and a link; one line on bad input."""
        parts = [capacities] if isinstance(capacities, int) else (
            str(capacities).split(",") if isinstance(capacities, str) else list(capacities))
        sizes = []
        for part in parts:
            try:
                size = int(str(part).strip())
            except ValueError:
                raise VatError(f"--offload takes a comma list of resident experts per layer (e.g. 8,16), got "
                               f"`{part}`") from None
            if size < 1:
                raise VatError(f"--offload: resident experts per layer must be >= 1, got {size}")
            sizes.append(size)
        if not sizes:
            raise VatError("--offload takes a comma list of resident experts per layer (e.g. 8,16), got nothing")
        if policy not in RESIDENCY_POLICIES:
            raise VatError(f"--offload-policy `{policy}`: one of {', '.join(RESIDENCY_POLICIES)}")
        if link not in HOST_LINKS:
            raise VatError(f"--offload-link `{link}`: one of {', '.join(HOST_LINKS)}")
        return cls(capacities=tuple(sorted(set(sizes))), policy=policy, link=link)

    def check(self, num_experts: int, top_k: int) -> None:
        """Every C fits the target: k <= C <= E (a token's k experts must be resident together)."""
        for size in self.capacities:
            if size < top_k or size > num_experts:
                raise VatError(f"--offload {size}: resident experts per layer must be between the target's top_k "
                               f"({top_k}) and its experts per layer ({num_experts})")


@dataclass
class Access:
    """What one forward did to one layer's cache: experts it found resident, loaded over the link, or filled into a
    free slot (free: the cache is still warming)."""

    hits: int = 0
    loads: int = 0
    fills: int = 0


class ResidencyCache:
    """One MoE layer's resident experts under an eviction policy.

    A forward's executed set is handled in this order: its resident experts are used (recency and use count
    updated), then its non-resident ones are brought in, lowest id first, each into a free slot (a *fill*) or in
    place of a victim (a *load*). The victim: LRU, the resident expert whose last forward is the oldest; LFU, the one
    executed by the fewest forwards so far (ties: the oldest, then the lowest id). Experts of the current forward are
    evicted only when nothing else is resident (C smaller than the forward's union: they stream through).
    """

    def __init__(self, capacity: int, policy: str = "lru"):
        if policy not in RESIDENCY_POLICIES:
            raise VatError(f"unknown residency policy `{policy}`: one of {', '.join(RESIDENCY_POLICIES)}")
        self.capacity = int(capacity)
        self.policy = policy
        self.last_use: dict[int, int] = {}  # resident expert -> the forward that last executed it
        self.uses: dict[int, int] = {}  # expert -> forwards that executed it (resident or not)
        self.forward = 0

    @property
    def resident(self) -> set[int]:
        return set(self.last_use)

    def access(self, experts: Sequence[int]) -> Access:
        """One forward executing ``experts`` (ids, any order, repeats ignored); returns its hits, loads and fills."""
        self.forward += 1
        needed = sorted({int(e) for e in experts})
        misses = [e for e in needed if e not in self.last_use]
        out = Access(hits=len(needed) - len(misses))
        for e in needed:
            self.uses[e] = self.uses.get(e, 0) + 1
            if e in self.last_use:
                self.last_use[e] = self.forward
        current = set(needed)
        for e in misses:
            if len(self.last_use) < self.capacity:
                out.fills += 1
            else:
                del self.last_use[self._victim(current)]
                out.loads += 1
            self.last_use[e] = self.forward
        return out

    def _victim(self, current: set[int]) -> int:
        others = [e for e in self.last_use if e not in current]
        pool = others or list(self.last_use)
        if self.policy == "lru":
            return min(pool, key=lambda e: (self.last_use[e], e))
        return min(pool, key=lambda e: (self.uses[e], self.last_use[e], e))


class LayerCaches:
    """One :class:`ResidencyCache` per MoE layer, priced in bytes: ``expert_bytes[l]`` per load in layer l."""

    def __init__(self, capacity: int, policy: str, expert_bytes: Sequence[float]):
        self.caches = [ResidencyCache(capacity, policy) for _ in expert_bytes]
        self.expert_bytes = [float(b) for b in expert_bytes]

    def access(self, expert_sets: Sequence[Sequence[int]]) -> tuple[float, int, int]:
        """One forward (experts per layer) -> (H2D bytes, hits, experts executed)."""
        h2d, hits, executed = 0.0, 0, 0
        for cache, nbytes, experts in zip(self.caches, self.expert_bytes, expert_sets, strict=True):
            got = cache.access(experts)
            h2d += got.loads * nbytes
            hits += got.hits
            executed += got.hits + got.loads + got.fills
        return h2d, hits, executed


OFFLOAD_COUNTS = ("h2d_bytes", "hits", "executed", "ar_h2d_bytes", "ar_hits", "ar_executed")


def input_sets(input_experts, position: int, num_experts: int) -> list[list[int]]:
    """The experts per layer one committed input position executed ((a + 1, L', k) ids; the sentinel dropped)."""
    return [[int(e) for e in layer if e < num_experts] for layer in input_experts[position].tolist()]


def replay_pass(runs: Sequence, capacity: int, policy: str, expert_bytes: Sequence[float],
                num_experts: int) -> list[dict[str, float]]:
    """Replay one pass (its prompts in order, every turn, every round) through warm-started caches of ``capacity``.

    Args:
        runs: the pass's :class:`vat.eval.metrics.PromptRun` list, decoded with ``record_experts``.
        capacity: C.
        policy: the eviction policy.
        expert_bytes: one expert's served bytes per MoE layer.
        num_experts: E (the sentinel id).

    Returns:
        One dict per prompt of :data:`OFFLOAD_COUNTS` summed over its turns: the decode's H2D bytes, hits and executed
        experts (Σ over forwards and layers of the union), and the same for its autoregressive baseline (one forward
        per kept token).
    """
    decode = LayerCaches(capacity, policy, expert_bytes)
    ar = LayerCaches(capacity, policy, expert_bytes)
    out = []
    for run in runs:
        counts = dict.fromkeys(OFFLOAD_COUNTS, 0.0)
        for gen in run.turns:
            for r in gen.rounds:
                if r.expert_sets is None:
                    raise VatError("the offload model needs the executed experts: decode with record_experts=True")
                _add(counts, "", decode.access(r.expert_sets))
                for position in range(r.committed):  # the tokens kept: what AR feeds, one forward each
                    _add(counts, "ar_", ar.access(input_sets(r.input_experts, position, num_experts)))
        out.append(counts)
    return out


def _add(counts: dict[str, float], prefix: str, access: tuple[float, int, int]) -> None:
    counts[prefix + "h2d_bytes"] += access[0]
    counts[prefix + "hits"] += access[1]
    counts[prefix + "executed"] += access[2]


def offload_seconds(counts: dict[str, float], modeled_seconds: float, modeled_ar_seconds: float,
                    link: HostLink) -> dict[str, float]:
    """A decode's modeled seconds under offload (the cost model's + H2D bytes / link bandwidth), and its AR's."""
    return {"modeled_seconds": modeled_seconds + counts["h2d_bytes"] / link.bytes_per_s,
            "modeled_ar_seconds": modeled_ar_seconds + counts["ar_h2d_bytes"] / link.bytes_per_s}


def offload_metrics(entries: Sequence[dict], capacity: int) -> dict[str, float | None]:
    """The ``offload`` metrics at one C of a set of ``per_prompt`` entries (ratios of sums, like τ).

    ``h2d_bytes_per_token`` = Σ H2D bytes / Σ kept tokens; ``hit_rate`` = Σ hits / Σ executed;
    ``modeled_offload_speedup_vs_ar`` = Σ modeled AR seconds under offload / Σ modeled seconds under offload; the
    ``ar_`` figures are the autoregressive baseline's (the same tokens, one forward each).
    """
    rows = [e["offload"][str(capacity)] for e in entries]
    total = {k: sum(float(r[k]) for r in rows) for k in (*OFFLOAD_COUNTS, "modeled_seconds", "modeled_ar_seconds")}
    kept = sum(e["kept"] for e in entries)

    def ratio(num: float, den: float) -> float | None:
        return num / den if den else None

    return {
        "h2d_bytes": total["h2d_bytes"], "h2d_bytes_per_token": ratio(total["h2d_bytes"], kept),
        "hit_rate": ratio(total["hits"], total["executed"]),
        "ar_h2d_bytes_per_token": ratio(total["ar_h2d_bytes"], kept),
        "ar_hit_rate": ratio(total["ar_hits"], total["ar_executed"]),
        "modeled_offload_seconds": total["modeled_seconds"], "modeled_offload_ar_seconds": total["modeled_ar_seconds"],
        "modeled_offload_tokens_per_s": ratio(kept, total["modeled_seconds"]),
        "modeled_offload_speedup_vs_ar": ratio(total["modeled_ar_seconds"], total["modeled_seconds"]),
    }


def add_offload(spec: OffloadSpec, cost_model, runs: Sequence, metrics: dict, entries: list[dict],
                num_experts: int) -> None:
    """Price one pass under offload at every C: each ``per_prompt`` entry (its ``modeled_*`` seconds already added by
    :func:`vat.eval.cost.add_costs`) gets ``offload`` {C: counts and seconds}, ``metrics`` gets ``offload``
    {C: :func:`offload_metrics`}."""
    link = HOST_LINKS[spec.link]
    expert_bytes = [e * cost_model.served_bytes for e in cost_model.target.expert_params]
    for capacity in spec.capacities:
        for entry, counts in zip(entries, replay_pass(runs, capacity, spec.policy, expert_bytes, num_experts),
                                 strict=True):
            seconds = offload_seconds(counts, entry["modeled_seconds"], entry["modeled_ar_seconds"], link)
            entry.setdefault("offload", {})[str(capacity)] = {**counts, **seconds}
    metrics["offload"] = pooled_offload(spec, entries)


def pooled_offload(spec: OffloadSpec, entries: list[dict]) -> dict[str, dict]:
    """:func:`offload_metrics` at every C of any set of ``per_prompt`` entries (a benchmark, or all pooled)."""
    return {str(c): offload_metrics(entries, c) for c in spec.capacities}


def describe(spec: OffloadSpec) -> dict:
    """The ``offload`` record of eval.json: what was modeled."""
    link = HOST_LINKS[spec.link]
    return {"capacities": list(spec.capacities), "policy": spec.policy, "link": link.name, "link_label": link.label,
            "link_bytes_per_s": link.bytes_per_s, "link_source": link.source, "warm_start": True}
