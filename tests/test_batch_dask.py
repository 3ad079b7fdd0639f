"""Batches on a real dask.distributed local cluster (the `resumable[dask]` extra)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chunk_files import committed

from resumable import BatchRecord, Pipeline, RowFailure, checkpointed_map

distributed = pytest.importorskip("distributed")


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    """A local cluster of two worker processes (one thread each), and a client for it."""
    with (
        distributed.LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as dask_client,
    ):
        yield dask_client


def root(x: int) -> float:
    """Runs on the workers (pickled by reference: this module is importable there)."""
    return math.sqrt(x)


def pid_of_row(_row: int) -> int:
    """The worker process a row ran in."""
    return os.getpid()


def test_map_on_dask_workers_inside_a_step(pipe: Pipeline, state_dir: Path, client: Any):
    """Pieces run on the cluster's workers; only this process writes; the step's chunks go at the end."""
    rows = [*range(20), -1, *range(21, 50)]

    @pipe.step
    def roots() -> list[Any]:
        return checkpointed_map(root, rows, every=6, executor=client.get_executor(), on_error="record")

    with pipe:
        out = roots()
    assert [RowFailure(20, "ValueError", "math domain error")] == [
        r for r in out if isinstance(r, RowFailure)
    ]
    assert [math.sqrt(x) for x in rows if x >= 0] == [r for r in out if not isinstance(r, RowFailure)]
    assert [] == [p for p in (state_dir / ".resumable" / "batches").rglob("*") if p.is_file()]


def test_rows_run_in_the_worker_processes(pipe: Pipeline, client: Any):
    """The function runs in the cluster's worker processes, not in the calling process."""
    with pipe:
        pids = set(checkpointed_map(pid_of_row, range(24), every=3, name="pids", executor=client))
    assert os.getpid() not in pids
    assert set(client.run(os.getpid).values()) >= pids


def test_a_client_is_accepted_and_a_failed_batch_resumes(pipe: Pipeline, state_dir: Path, client: Any):
    """A Client may be given directly; after an error the rerun does only the uncommitted pieces."""
    rows = [*range(30), -5, *range(31, 40)]
    with pipe, pytest.raises(ValueError, match="math domain error"):
        checkpointed_map(root, rows, every=5, name="roots", executor=client, concurrency=2)
    directory = state_dir / ".resumable" / "batches" / "named" / "roots"
    done = {(start, end) for start, end, _ in committed(directory)}
    assert (30, 35) not in done
    assert {(0, 5), (5, 10)} <= done

    rows[30] = 30
    with pipe:
        assert [math.sqrt(x) for x in range(40)] == checkpointed_map(
            root, rows, every=5, name="roots", executor=client
        )
    assert BatchRecord(done=40, every=5, total=40, failures=0) == pipe.status().batches["roots"]
