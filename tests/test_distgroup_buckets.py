"""The bucketed broadcast between worker groups (``distgroup.send_buckets``/``recv_buckets``) on
two real gloo ranks: every tensor arrives whole and equal, whatever its dtype and length, including
a 2-byte tensor of odd length followed by an int64 one (an unaligned offset for ``view``)."""
from __future__ import annotations

import socket

import pytest

torch = pytest.importorskip("torch")


def _tensors() -> list[tuple[str, "torch.Tensor"]]:
    g = torch.Generator().manual_seed(0)
    return [("half_odd", torch.randn(7, generator=g).to(torch.bfloat16)),       # 14 bytes
            ("steps", torch.arange(5, dtype=torch.int64)),                      # lands at byte 14 unpadded
            ("mask", torch.tensor([True, False, True])),                         # 3 bytes
            ("w", torch.randn(3, 5, generator=g)),                               # float32 after 1-byte items
            ("d", torch.randn(3, generator=g, dtype=torch.float64)),
            ("empty", torch.zeros(0, 4))]


def _rank(rank: int, port: int, bucket_bytes: int, out: str) -> None:
    import torch.distributed as dist

    from hpc_verl.dataflow import distgroup
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    pg = distgroup.new_sync_group(store, "t", rank, 2, "gloo", 60)
    if rank == 0:
        distgroup.send_buckets(pg, iter(_tensors()), torch.device("cpu"), bucket_bytes=bucket_bytes)
    else:
        got = [(n, t.clone()) for n, t in distgroup.recv_buckets(pg, torch.device("cpu"))]
        torch.save(got, out)


@pytest.mark.parametrize("bucket_bytes", [1, 24, 1 << 20])   # one tensor a bucket, a few, all in one
def test_every_dtype_and_odd_length_arrives_whole(tmp_path, bucket_bytes):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "got.pt")
    ctx = torch.multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, bucket_bytes, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    got = torch.load(out)
    want = _tensors()
    assert [n for n, _ in got] == [n for n, _ in want]
    for (n, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), n
