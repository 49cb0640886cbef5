"""What the SGLang integration tests read off real SGLang servers: idle and leak-free, and proof that KV moved.

SGLang's counterpart of ``pd_checks`` (the vLLM tests'): ``assert_drained`` waits until a server has no
request left and requires it alive with no leak in its log (servers run with SGLang's strict idle memory
check); ``check_transferred`` sends one P->D request and checks, from both servers' /metrics, that exactly
the prompt's KV moved with no failure, and returns P's per-layer pushes for it (``layer_pushes``,
``fresh_pushes``). Used by ``integration_tests/test_sglang.py``.
"""

from __future__ import annotations

import re
import time
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from integration_tests.pd_checks import metric
from integration_tests.sglang_client import Reply, body, generate_pd, get_json, post, streaming
from pd_disagg.engines import base_url
from pd_disagg.servers import ManagedServer
from pd_disagg.tiny_model import PRESETS
from tests.polling import wait_until

# ~150 tokens: with --chunked-prefill-size 48, P prefills (and sends) it in several chunks.
LONG_PROMPT = "".join(f"value_{i} = compute(value_{i - 1}, {i})\n" for i in range(1, 16))
CHUNK_TOKENS = 48
# The SLO scheduler's prompt: prefilled once in 16-token chunks (aggregated) and once by the stock P/D pair.
SLO_PROMPT = "".join(f"total_{i} = merge(total_{i - 1}, {i * 7})\n" for i in range(1, 16))
#: The stream running beside ``SLO_PROMPT``: long enough to decode through its whole prefill.
COMPANION_PROMPT, COMPANION_TOKENS = "The list of primes starts", 400
#: Sent beside a stream whose TPOT target is ``TPOT_TARGET_MS``: the steps' limit is that stream's account.
TPOT_PROMPT = "".join(f"row_{i} = scale(row_{i - 1}, {i * 5})\n" for i in range(1, 9))
TPOT_TARGET_MS = 50
SLO_MIN_CHUNK = 16  # scheduler_plugins' minimum chunk (one 16-token alignment unit) on SGLang's 1-token pages
NUM_LAYERS = PRESETS["tiny"].num_layers
MAX_NEW_TOKENS = 12
#: KV bytes of one token of the tiny model in bfloat16 (SGLang's pages here are one token each).
TOKEN_KV_BYTES = PRESETS["tiny"].kv_bytes_per_token(2)


def bootstrap(port: int) -> tuple[str, int]:
    """P's bootstrap server on this host."""
    return ("127.0.0.1", port)


def assert_drained(server: ManagedServer, timeout_s: float = 30) -> None:
    """Wait until ``server`` has no request in any queue, then require it alive and leak-free.

    SGLang's idle self-check (strict mode) runs once the scheduler is idle with empty queues; a leaked
    page or request slot raises there and kills the scheduler, which the health check then sees.
    """
    wait_until(lambda: _idle(get_json(base_url(server) + "/v1/loads")), timeout_s, f"{server.name} idle")
    time.sleep(2)  # not a synchronisation: the time in which SGLang's idle self-check runs a few times
    assert server.alive(), server.log_tail()
    log = server.log_path.read_text(errors="replace")
    assert "leak detected" not in log.lower(), server.log_tail()
    assert "Mem Leak Detected" not in log, server.log_tail()


def _idle(loads: object) -> bool:
    """True when every count of requests (running, queued, bootstrapping, transferring) is zero."""
    counts: list[int] = []

    def walk(node: object, key: str = "") -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        elif isinstance(node, int) and key.startswith("num_") and key.endswith("reqs"):
            counts.append(node)

    walk(loads)
    assert counts, f"/v1/loads reports no request counts: {loads}"
    return not any(counts)


def transfer_metric(server: ManagedServer, key: str) -> float:
    return metric(base_url(server), f"sglang:pd_connector_{key}")


def check_transferred(
    prefill: ManagedServer,
    decode: ManagedServer,
    port: int,
    reference: dict[str, Reply],
    prompt: str = LONG_PROMPT,
) -> tuple[int, dict[tuple[str, int], float]]:
    """One P->D request of ``prompt`` (several chunks): D answers as the aggregated server, and the backend's
    metrics on both /metrics say the prompt's KV moved, exactly, with no failure. Returns the prompt's tokens
    and the layer pushes P made for it."""
    keys = ("bytes_sent_total", "bytes_received_total", "failures_total", "transfer_seconds_count")
    pushes = layer_pushes(prefill)
    before = {(s.name, k): transfer_metric(s, k) for s in (prefill, decode) for k in keys}

    def grew(server: ManagedServer, key: str) -> float:
        return transfer_metric(server, key) - before[(server.name, key)]

    p, d = generate_pd(base_url(prefill), base_url(decode), bootstrap(port), prompt, MAX_NEW_TOKENS)
    assert p.ok and d.ok, (p, d)
    assert d.output_ids == reference[prompt].output_ids
    wait_until(
        lambda: grew(prefill, "bytes_sent_total") > 0 and grew(decode, "bytes_received_total") > 0,
        timeout_s=10,
        what="the transfer on both /metrics",
    )
    prompt_tokens = int(p.body["meta_info"]["prompt_tokens"])
    assert grew(prefill, "bytes_sent_total") == prompt_tokens * TOKEN_KV_BYTES
    assert grew(decode, "bytes_received_total") == grew(prefill, "bytes_sent_total")
    assert grew(prefill, "transfer_seconds_count") == 1
    assert grew(prefill, "failures_total") == grew(decode, "failures_total") == 0
    return prompt_tokens, {k: v - pushes[k] for k, v in layer_pushes(prefill).items()}


def layer_pushes(server: ManagedServer) -> dict[tuple[str, int], float]:
    """P's layer pushes so far, by (when, layer), from one read of its /metrics (0 where none happened)."""
    with urllib.request.urlopen(base_url(server) + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    pushes = {(when, layer): 0.0 for when in ("forward", "computed", "chunk") for layer in range(NUM_LAYERS)}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sglang:pd_connector_layer_pushes_total":
                pushes[(sample.labels["when"], int(sample.labels["layer"]))] += sample.value
    return pushes


def per_layer(forward: int, computed: int, chunk: int) -> dict[tuple[str, int], float]:
    counts = {"forward": forward, "computed": computed, "chunk": chunk}
    return {(when, layer): n for when, n in counts.items() for layer in range(NUM_LAYERS)}


def fresh_pushes(tokens: int) -> dict[tuple[str, int], float]:
    """P's layer pushes for a prompt of ``tokens`` it never saw: every layer once per forward pass (chunk) that
    computes tokens before the last one, during the pass; the last token's page after the last pass."""
    return per_layer(forward=-(-(tokens - 1) // CHUNK_TOKENS), computed=0, chunk=1)


#: ... and for a prompt it has cached: the prefix before the forward, the last token's page after it.
CACHED_PUSHES = per_layer(forward=0, computed=1, chunk=1)


def decode_transfer_queue(decode: ManagedServer) -> int:
    """Requests in D's transfer queue (``decode_transfer_queue_reqs`` of SGLang's /v1/loads): D moves a
    request there once it has bootstrapped with P and sent P the destinations of its KV."""
    found: list[int] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key.endswith("decode_transfer_queue_reqs") and isinstance(value, int):
                    found.append(value)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    loads = get_json(base_url(decode) + "/v1/loads")
    walk(loads)
    assert found, f"SGLang's /v1/loads has no decode_transfer_queue_reqs: {loads}"
    return sum(found)


@dataclass(frozen=True)
class Aggregated:
    """What the aggregated (SLO-scheduled) server answered: the reference replies, and its reply to
    ``SLO_PROMPT`` under a 1 ms ITL target with the server log before and during that request; then the log
    during ``TPOT_PROMPT``, sent beside a stream with a TPOT target of ``TPOT_TARGET_MS``."""

    replies: dict[str, Reply]
    slo_reply: Reply
    reference_log: str
    slo_log: str
    tpot_log: str


def assert_slo_chunks(aggregated: Aggregated, loose_target_ms: float) -> None:
    """From the SLO-scheduled server's log: before the tight request, every decision at the server's loose
    target was SGLang's own chunk size; during it, every decision was at the request's 1 ms target (a stream
    decoding beside it), at least the minimum chunk and aligned to it or the whole room (more than the
    minimum where the step costs little more, ``lost_target_slack``), and SGLang ran the prompt in exactly
    the decided chunks, step by step (SGLang's own "Prefill batch" lines: new tokens per step, and the
    cached prefix of the first)."""
    assert aggregated.slo_reply.ok, aggregated.slo_reply
    prompt_tokens = int(aggregated.slo_reply.body["meta_info"]["prompt_tokens"])
    reference_log, slo_log = aggregated.reference_log, aggregated.slo_log
    decision = r"SLO scheduler chunk: itl_target_ms=(\S+) chunk=(\d+)"
    loose = set(re.findall(decision, reference_log))
    assert loose == {(f"{loose_target_ms:g}", str(CHUNK_TOKENS))}, loose
    decisions = re.findall(decision, slo_log)
    assert {target for target, _ in decisions} == {"1"}, decisions
    decided = [int(chunk) for _, chunk in decisions]
    # Aligned, or the whole room SGLang's chunk size leaves beside the one stream.
    room = CHUNK_TOKENS - 1
    assert all(
        chunk >= SLO_MIN_CHUNK and (chunk % SLO_MIN_CHUNK == 0 or chunk == room) for chunk in decided
    ), decided
    batches = re.findall(r"Prefill batch, #new-seq: 1, #new-token: (\d+), #cached-token: (\d+)", slo_log)
    chunks = [int(new) for new, _ in batches]
    assert len(chunks) > 1, (prompt_tokens, chunks)  # chunked, not one step
    # One decision per prefill step, in order: each step ran the chunk decided for it (the last, the rest).
    assert chunks[:-1] == decided[: len(chunks) - 1], (chunks, decided)
    assert 0 < chunks[-1] <= decided[len(chunks) - 1], (chunks, decided)
    assert sum(chunks) + int(batches[0][1]) == prompt_tokens, (batches, prompt_tokens)


def answer_with_target(
    server: ManagedServer,
    prompt: str,
    max_new_tokens: int,
    targets: dict[str, float],
    companion_targets: dict[str, float] | None = None,
) -> tuple[Reply, str, str]:
    """Greedy ``/generate`` with the request's own ``targets`` (``custom_params``, read by
    scheduler_plugins.sglang), sent while another request streams (with ``companion_targets``, if any): its
    prefill shares every step with a decode (a prefill alone is not chunked, ``budget.step_limit_s``).
    Returns the reply and the server log before and during the request."""
    companion = body(COMPANION_PROMPT, COMPANION_TOKENS, None, None)
    companion["sampling_params"]["ignore_eos"] = True
    if companion_targets:
        companion["sampling_params"]["custom_params"] = companion_targets
    with streaming(base_url(server), companion, events=3, timeout_s=120) as seen:
        assert seen == 3, f"the companion stream ended after {seen} events"
        logged = len(server.log_path.read_bytes())
        sampling = {
            "temperature": 0,
            "max_new_tokens": max_new_tokens,
            # No TTFT deadline within reach: the chunks are the ITL target's alone.
            "custom_params": {**targets, "ttft_target_ms": 3_600_000},
        }
        payload = {"text": prompt, "sampling_params": sampling}
        reply = post(base_url(server) + "/generate", payload, timeout_s=120)
        log = server.log_path.read_bytes()
    return reply, log[:logged].decode(errors="replace"), log[logged:].decode(errors="replace")


def assert_tpot_limited(aggregated: Aggregated, loose_target_ms: float) -> None:
    """Beside the stream with a TPOT target, every step that planned a chunk was limited by the stream's
    account: at most 0.85 x ``TPOT_TARGET_MS`` x its gaps (``budget.tpot_limit_s``, less the time spent and
    the steps to come), far under the loose ITL target's limit (0.85 x ``loose_target_ms``), which is the
    limit without the account. The account is lost (and the limit the ITL one) only if the stream's decode
    steps alone took over 40 ms."""
    decision = (
        rf"SLO scheduler chunk: itl_target_ms={loose_target_ms:g} chunk=\d+ decodes=1 \S+ limit_ms=(\S+)"
    )
    limits = [float(limit) for limit in re.findall(decision, aggregated.tpot_log)]
    bound_ms = 0.85 * TPOT_TARGET_MS * (COMPANION_TOKENS - 1)
    assert bound_ms < 0.85 * loose_target_ms
    assert limits and all(limit < bound_ms for limit in limits), (limits, bound_ms)
