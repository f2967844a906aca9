"""The gloo weight transfer's bucket plan: whole decoder layers per bucket, aligned offsets, the same on both
sides, and every tensor exactly once in metadata order."""

from __future__ import annotations

import torch

from ajet_hpc.engine.weight_transfer import ALIGN, bucket_size, buckets


def layer_names(layers: int) -> list[str]:
    names = ["model.embed_tokens.weight"]
    for i in range(layers):
        names += [f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.mlp.down_proj.weight"]
    return [*names, "model.norm.weight"]


def test_buckets_hold_whole_layers_in_order() -> None:
    names = layer_names(4)
    shapes = [(1000, 64)] + [(64, 64), (64, 100)] * 4 + [(64,)]
    dtypes = [torch.float32] * len(names)
    layer_bytes = 64 * 64 * 4 + 64 * 100 * 4  # 41.6 KB per decoder layer
    plan = buckets(names, shapes, dtypes, bucket_bytes=2 * layer_bytes + 1000)
    assert [p.index for bucket in plan for p in bucket] == list(range(len(names)))
    # the embedding (256 KB) is bigger than a bucket: it travels alone; then two layers per bucket
    groups = [[names[p.index].split(".")[2] if "layers" in names[p.index] else "x" for p in b] for b in plan]
    assert groups == [["x"], ["0", "0", "1", "1"], ["2", "2", "3", "3", "x"]]
    for bucket in plan:
        assert all(p.offset % ALIGN == 0 for p in bucket)
        ends = [p.offset + p.nbytes for p in bucket]
        assert all(end <= nxt.offset for end, nxt in zip(ends, bucket[1:], strict=False))  # no overlap
        assert bucket_size(bucket) == ends[-1]


def test_mixed_dtypes_share_a_bucket_as_bytes() -> None:
    names = ["model.layers.0.a.weight", "model.layers.0.b.weight"]
    plan = buckets(names, [(3,), (5,)], [torch.bfloat16, torch.float32], bucket_bytes=1 << 20)
    (bucket,) = plan
    assert [(p.offset, p.nbytes) for p in bucket] == [(0, 6), (ALIGN, 20)]
