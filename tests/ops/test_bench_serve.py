"""The serving benchmark against an in-process zenserve: it counts what the server streamed."""

from __future__ import annotations

import argparse

import pytest

from ops import bench_serve
from ops.bench_serve import percentiles
from tests.server.conftest import make_client  # noqa: F401  (the live-server fixture)


def test_percentiles_interpolate():
    assert percentiles([1.0, 2.0, 3.0, 4.0], ps=(50,)) == {"p50": 2.5}
    assert percentiles([5.0], ps=(90,)) == {"p90": 5.0}


def test_prompts_have_the_exact_token_length_and_share_the_prefix(smollm_fp32):
    prompts = bench_serve.make_prompts(3, 40, 24, seed=1)
    ids = [smollm_fp32.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    assert all(abs(len(i) - 40) <= 1 for i in ids)  # re-encoding a decoded cut may merge one pair
    assert ids[0][:20] == ids[1][:20] == ids[2][:20]
    assert len({tuple(i) for i in ids}) == 3


async def test_bench_against_a_live_server(make_client):
    client = await make_client()
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    args = parser.parse_args([
        "--base-url", str(client.make_url("/")), "--model", "SmolLM2-135M-Instruct.Q4_1",
        "--prompt-tokens", "32", "--max-tokens", "6", "--num-requests", "4", "--concurrency", "2",
    ])
    report = await bench_serve.run(args)
    assert report["completed"] == 4 and report["failed"] == 0
    assert report["output_tok_s"] > 0 and report["ttft_ms"]["p50"] > 0
    assert report["itl_ms"]["p50"] > 0
    records = report["requests"]
    assert len(records) == 4 and all(r["ok"] and r["output_tokens"] == 6 for r in records)
    sent = [r["sent_s"] for r in records]
    assert sent == sorted(sent) and sent[0] >= 0
    # Two at a time: the third waits for one of the first two to finish.
    assert sent[2] >= min(records[0]["sent_s"] + records[0]["e2e_s"], records[1]["sent_s"] + records[1]["e2e_s"]) - 0.01
    assert percentiles([r["ttft_ms"] for r in records]) == pytest.approx(report["ttft_ms"])


def test_percentiles_of_nothing_are_null_not_nan():
    import json

    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}
    json.dumps(percentiles([]), allow_nan=False)  # valid JSON


@pytest.mark.parametrize(
    "argv",
    [["--concurrency", "0"], ["--concurrency", "-3"], ["--num-requests", "0"], ["--prompt-tokens", "-5"],
     ["--request-rate", "-1"], ["--max-duration", "0"], ["--request-rate", "nan"]],
)
def test_bench_serve_refuses_counts_and_rates_out_of_range(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_serve.main(["--base-url", "http://127.0.0.1:9", "--model", "m", *argv])
    assert exit_info.value.code == 2


def test_bench_serve_refuses_a_json_path_it_could_not_write_before_running(capsys):
    rc = bench_serve.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--json", "/nonexistent/dir/x.json"])
    assert rc == 2 and "cannot write" in capsys.readouterr().err
