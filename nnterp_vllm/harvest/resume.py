"""What a rerun may trust: recorded shards whose corpus digests the corpus read now reproduces."""

from __future__ import annotations

from collections.abc import Iterator

from .compute import Unit
from .corpus import Digested
from .store import OVERWRITE, HarvestError, Store


class Resume:
    """What a rerun may trust: the recorded shards whose corpus digests the corpus read now reproduces.

    A recorded shard is skipped only once the corpus read through it hashes as its record says;
    a difference, a corpus longer than a finished harvest's or shorter than the shards recorded,
    is refused with HarvestError naming the first shard that differs.
    """

    def __init__(self, store: Store) -> None:
        self.store = store

    def _changed(self, what: str) -> HarvestError:
        return HarvestError(
            f"the corpus is not the one {self.store.out} was harvested from "
            f"({self.store.manifest.get('corpus', 'unknown')}): {what}. Harvest that corpus again, choose another "
            f"--out directory, or use {OVERWRITE} to harvest this one from scratch."
        )

    def check(self, unit: Unit) -> None:
        """Refuse ``unit`` if the corpus read through it differs from what its record says."""
        store = self.store
        record = store.recorded.get(unit.index)
        if record is None:
            if store.recorded_complete:
                raise self._changed(f"it now yields more than the {len(store.recorded)} shards of the finished harvest")
        elif record.get("corpus_sha256") != unit.corpus_sha256:
            raise self._changed(
                f"a document read for {record['file']} (documents {record['first_document']} to "
                f"{record['last_document']}) differs"
            )

    def check_end(self, last_index: int, documents: Digested) -> None:
        """Refuse a corpus that ended before the recorded shards, or that differs after a finished harvest's last."""
        store = self.store
        beyond = sorted(index for index in store.recorded if index > last_index)
        if beyond:
            raise self._changed(f"it now ends before {store.recorded[beyond[0]]['file']}")
        if store.recorded_complete and store.manifest.get("corpus_sha256") != documents.hexdigest():
            raise self._changed("documents after the last shard's differ")

    def pending(self, units: Iterator[Unit], documents: Digested) -> Iterator[Unit]:
        """The units still to compute, each checked against the record of the same index first."""
        last = -1
        for unit in units:
            self.check(unit)
            last = unit.index
            if unit.index not in self.store.done:
                yield unit
        self.check_end(last, documents)

    def prove_recorded(self, units: Iterator[Unit], documents: Digested) -> None:
        """Check every recorded shard's digest in a pass of its own, computing nothing.

        Needed before the first unit is computed when a shard to compute comes before recorded
        ones (a damaged shard, or out-of-order Ray workers): otherwise a difference after it
        would only show once work had started.
        """
        last_recorded = max(self.store.recorded)
        last = -1
        for unit in units:
            self.check(unit)
            last = unit.index
            if last >= last_recorded:
                return
        self.check_end(last, documents)

    def needs_proof(self) -> bool:
        recorded = self.store.recorded
        return bool(recorded) and any(index not in self.store.done for index in range(max(recorded) + 1))
