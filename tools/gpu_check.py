"""A short check of the server path on a CUDA GPU (run by hand on a GPU machine; CI has none).

The built-in tiny model behind the real app with the transformers engine (bf16 on CUDA, as `dtype: auto`
picks), driven with the real openai client: chat with and without streaming, token recording, logprobs
against a bf16 re-scoring, 64 concurrent episodes. Prints one line per check and ends with
``GPU_CHECK ok`` or raises.

    python tools/gpu_check.py
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from server_harness import Harness

from ajet_hpc.engine.model_path import resolve_model


def main() -> None:
    if "--allow-cpu" not in sys.argv:  # --allow-cpu: a dry run of this script on a machine without a GPU
        assert torch.cuda.is_available(), "no CUDA device"
        print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__)
    model = resolve_model("builtin:tiny", Path(tempfile.mkdtemp()))
    started = time.monotonic()
    harness = Harness("transformers", model)
    server = harness.serve()
    engine_model = harness.engine._model  # the engine's own weights, for the re-scoring below
    print(
        f"engine up in {time.monotonic() - started:.1f}s on {engine_model.device}, dtype {engine_model.dtype}"
    )
    try:
        begun = server.begin(task_id="gpu")
        client = openai.OpenAI(base_url=begun["base_url"], api_key=begun["api_key"], max_retries=0)
        messages = [{"role": "user", "content": "2+3="}]
        first = client.chat.completions.create(
            model="policy", messages=messages, max_tokens=16, temperature=0
        )
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "user", "content": "again"},
        ]
        stream = client.chat.completions.create(model="policy", messages=messages, max_tokens=16, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        record = server.episode(begun["episode_id"])
        timelines = record["timelines"]
        assert len(timelines) == 2 and timelines[1]["reused_spans"], record
        print("chat + streaming: ok;", repr(first.choices[0].message.content), repr(streamed))
        ids = torch.tensor(
            [timelines[0]["prompt_ids"] + timelines[0]["response_ids"]], device=engine_model.device
        )
        with torch.no_grad():
            logp = torch.log_softmax(engine_model(ids).logits[0, :-1].float(), -1)
        start = len(timelines[0]["prompt_ids"])
        expected = logp[start - 1 :].gather(1, ids[0, start:, None])[:, 0].cpu()
        got = torch.tensor(timelines[0]["response_logprobs"])
        gap = (got - expected).abs().max().item()
        assert gap < 5e-2, gap
        print(f"logprobs vs bf16 re-scoring: max gap {gap:.2e}")

        async def one(http: httpx.AsyncClient, index: int) -> None:
            b = (await http.post("/v1/episodes", json={"task_id": str(index)}, headers=server.admin)).json()
            body = {"model": "policy", "messages": [{"role": "user", "content": f"{index}"}], "max_tokens": 8}
            reply = await http.post(
                f"{b['base_url']}/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {b['api_key']}"},
            )
            reply.raise_for_status()
            ended = await http.post(
                f"/v1/episodes/{b['episode_id']}/end", json={"reward": 1.0}, headers=server.admin
            )
            ended.raise_for_status()

        async def many() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
                await asyncio.gather(*(one(http, i) for i in range(64)))

        started = time.monotonic()
        asyncio.run(many())
        print(f"64 concurrent episodes: ok in {time.monotonic() - started:.1f}s; status {server.status()}")
    finally:
        harness.close()
    print("GPU_CHECK ok")


if __name__ == "__main__":
    main()
