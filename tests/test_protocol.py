"""PeerReq codec, the receiver's ledger rules, anchors, commit assembly, tokenizer check."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenrouter_ray.protocol import (
    PROTOCOL_VERSION,
    Anchors,
    CommitLog,
    Dropped,
    FinishSummary,
    MsgKind,
    PeerReq,
    ProtocolError,
    RequestLedger,
    RouteState,
    SamplingSpec,
    TokenInfo,
    TokenizerMismatchError,
    by_destination,
    check_shared_tokenizer,
    decode,
    decode_batch,
    encode,
    encode_batch,
    with_own_size,
)

int64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
token = st.integers(min_value=0, max_value=2**31 - 1)
count = st.integers(min_value=0, max_value=2**40)
text = st.text(max_size=24)
scalar = st.none() | st.booleans() | int64 | st.floats(allow_nan=False) | text
extra_value = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4), max_leaves=8)

samplings = st.builds(
    SamplingSpec,
    temperature=st.floats(0, 2),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(0, 1000),
    seed=st.none() | int64,
    max_tokens=st.integers(1, 1 << 20),
    stop_token_ids=st.lists(token, max_size=4).map(tuple),
    logprobs=st.none() | st.integers(0, 20),
    trace=st.booleans(),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0, 10, exclude_min=True),
    min_p=st.floats(0, 1),
    logit_bias=st.dictionaries(token, st.floats(-100, 100), max_size=3).map(
        lambda d: tuple(sorted(d.items()))
    ),
    min_tokens=st.integers(0, 1 << 20),
)


names = st.text(max_size=8)
seconds = st.floats(0, 1e9, allow_nan=False)
score = st.none() | st.floats(allow_nan=False)
droppeds = st.builds(Dropped, model=names, token=token, score=score)
token_infos = st.builds(
    TokenInfo,
    score=score,
    logprob=st.none() | st.floats(max_value=0, allow_nan=False),
    top_ids=st.lists(token, max_size=3),
    top_logprobs=st.lists(st.floats(max_value=0, allow_nan=False), max_size=3),
    dropped=st.lists(droppeds, max_size=2),
)
routes = st.builds(
    RouteState,
    ingress=text,
    prompt_len=count,
    anchors=st.dictionaries(names, count, max_size=3),
    endpoints=st.dictionaries(names, text, max_size=3),
    counts=st.dictionaries(names, count, max_size=3),
    handoffs=count,
    deadline=st.none() | st.floats(allow_nan=False),
    queue_s=st.none() | seconds,
    pending_s=st.dictionaries(names, seconds, max_size=3),
    pending_since=st.dictionaries(names, seconds, max_size=3),
    peer_bytes=count,
    dropped=count,
    drops=st.lists(droppeds, max_size=2),
)
summaries = st.builds(
    FinishSummary,
    counts=st.dictionaries(names, count, max_size=3),
    handoffs=count,
    error=st.none() | text,
    queue_s=st.none() | seconds,
    pending_s=st.dictionaries(names, seconds, max_size=3),
    peer_bytes=count,
    dropped=count,
)


@st.composite
def peer_reqs(draw: st.DrawFn) -> PeerReq:
    tokens = draw(st.lists(token, max_size=40))
    committed = draw(st.integers(0, len(tokens)))
    infos = draw(st.just([]) | st.lists(token_infos, min_size=committed, max_size=committed))
    return PeerReq(
        rid=draw(text),
        src=draw(text),
        dst=draw(text),
        kind=draw(st.sampled_from(MsgKind)),
        handoff_seq=draw(count),
        tokens=tokens,
        anchor=draw(count),
        committed=committed,
        finish_reason=draw(st.none() | st.sampled_from(["stop", "length", "abort"])),
        sampling=draw(st.none() | samplings),
        route=draw(st.none() | routes),
        summary=draw(st.none() | summaries),
        extras=draw(st.dictionaries(text, extra_value, max_size=4)),
        active_requests=draw(st.none() | count),
        sent_at=draw(int64),
        token_info=infos,
    )


def msg(rid: str, kind: MsgKind, seq: int, tokens: list[int] | None = None) -> PeerReq:
    tokens = tokens or []
    return PeerReq(rid, "small/0", "large/0", kind, seq, tokens, committed=len(tokens))


@settings(deadline=None)
@given(peer_reqs())
def test_codec_round_trip(m: PeerReq) -> None:
    assert decode(encode(m)) == m


@settings(deadline=None)
@given(st.lists(peer_reqs(), max_size=5))
def test_batch_codec_round_trip(msgs: list[PeerReq]) -> None:
    assert decode_batch(encode_batch(msgs)) == msgs


def test_wire_form_is_versioned_and_positional() -> None:
    m = msg("r1", MsgKind.HANDOFF, 3, [7, 8])
    raw = msgspec.msgpack.decode(encode(m))
    assert raw[:6] == [PROTOCOL_VERSION, "r1", "small/0", "large/0", 1, 3]
    raw.append("a field added later")  # optional trailing fields: no version bump needed
    assert decode(msgspec.msgpack.encode(raw)) == m
    raw[0] = PROTOCOL_VERSION + 1
    with pytest.raises(ProtocolError, match=f"v{PROTOCOL_VERSION}"):
        decode(msgspec.msgpack.encode(raw))


def test_bad_frames_raise_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        decode(b"\x00garbage")
    with pytest.raises(ProtocolError):
        decode_batch(encode(msg("r", MsgKind.NEW, 0)))  # a message is not a batch
    raw = msgspec.msgpack.decode(encode(msg("r", MsgKind.NEW, 0, [1])))
    raw[8] = 5  # committed > len(tokens)
    with pytest.raises(ProtocolError, match="committed"):
        decode(msgspec.msgpack.encode(raw))


def test_route_state_and_summary_are_typed_on_the_wire() -> None:
    route = RouteState("ingress/0", 5, anchors={"small": 7}, counts={"small": 2}, handoffs=1)
    m = PeerReq("r", "small/0", "large/0", MsgKind.HANDOFF, 2, [4, 5], anchor=5, route=route)
    got = decode(encode(m))
    assert got.route == route and got.route.anchors == {"small": 7} and got.extras == {}
    raw = msgspec.msgpack.decode(encode(m))
    raw[11][2] = {"small": -1}  # an anchor cannot be negative
    with pytest.raises(ProtocolError, match=r"int` >= 0 - at `\$\[11\]\[2\]"):
        decode(msgspec.msgpack.encode(raw))
    raw[11] = {"anchors": {"small": 7}}  # v1 put route state in a map: refused, not guessed
    with pytest.raises(ProtocolError):
        decode(msgspec.msgpack.encode(raw))
    done = PeerReq("r", "large/0", "ingress/0", MsgKind.FINISHED, 3, anchor=9,
                   summary=FinishSummary({"large": 1}, handoffs=1, error="boom"))  # fmt: skip
    assert decode(encode(done)).summary.error == "boom"


def test_sampling_is_the_engines_type_and_checked_on_decode() -> None:
    from tokenrouter_ray.engine.request import SamplingParams

    assert SamplingSpec is SamplingParams  # one type from the OpenAI layer to the sampler
    m = PeerReq("r", "ingress/0", "small/0", MsgKind.NEW, 0, [1], sampling=SamplingSpec())
    assert decode(encode(m)).sampling == SamplingSpec(temperature=0.0, max_tokens=16)
    raw = msgspec.msgpack.decode(encode(m))
    raw[10][1] = 0.0  # top_p = 0 samples nothing: the frame is refused, not run
    with pytest.raises(ProtocolError, match="top_p"):
        decode(msgspec.msgpack.encode(raw))


def test_token_info_is_one_per_committed_token() -> None:
    info = TokenInfo(0.25, -0.1, [4, 9], [-0.1, -2.5], [Dropped("small", 3, 0.9)])
    m = PeerReq("r", "large/0", "ingress/0", MsgKind.COMMIT, 1, [4], 9, 1, token_info=[info])
    assert decode(encode(m)).token_info == [info]
    with pytest.raises(ValueError, match="token_info"):
        PeerReq("r", "large/0", "ingress/0", MsgKind.COMMIT, 1, [4], 9, 1, token_info=[info] * 2)
    assert PeerReq("r", "large/0", "ingress/0", MsgKind.COMMIT, 1, [4], 9, 1).token_info == []


@settings(deadline=None)
@given(peer_reqs(), routes)
def test_with_own_size_counts_the_message_exactly(m: PeerReq, route: RouteState) -> None:
    sized = with_own_size(msgspec.structs.replace(m, route=route))
    assert sized.route.peer_bytes - route.peer_bytes == len(encode(sized))
    assert msgspec.structs.replace(sized.route, peer_bytes=route.peer_bytes) == route


def test_sent_at_defaults_to_wall_clock_ns() -> None:
    import time

    before = time.time_ns()
    assert before <= msg("r", MsgKind.NEW, 0).sent_at <= time.time_ns()


def test_ledger_ignores_duplicate_stale_and_reordered() -> None:
    ledger = RequestLedger()
    assert ledger.accept(msg("r", MsgKind.NEW, 0, [1, 2, 3]))
    assert not ledger.accept(msg("r", MsgKind.NEW, 0, [1, 2, 3]))  # duplicate
    assert ledger.accept(msg("r", MsgKind.HANDOFF, 2))
    assert not ledger.accept(msg("r", MsgKind.HANDOFF, 1))  # reordered, older
    assert not ledger.accept(msg("r", MsgKind.HANDOFF, 2))  # duplicate
    assert ledger.held_seq("r") == 2
    assert ledger.accept(msg("r", MsgKind.HANDOFF, 5))
    assert ledger.accept(msg("other", MsgKind.HANDOFF, 1))  # rids are independent
    assert ledger.held_seq("r") == 5


def test_ledger_finished_is_accepted_once_and_never_revived() -> None:
    ledger = RequestLedger()
    assert ledger.accept(msg("r", MsgKind.NEW, 0))
    assert ledger.accept(msg("r", MsgKind.HANDOFF, 4))
    assert ledger.accept(msg("r", MsgKind.FINISHED, 2))  # terminal: accepted whatever its seq
    assert ledger.is_finished("r") and ledger.held_seq("r") is None and ledger.num_live == 0
    assert not ledger.accept(msg("r", MsgKind.FINISHED, 6))
    assert not ledger.accept(msg("r", MsgKind.ABORT, 7))
    assert not ledger.accept(msg("r", MsgKind.HANDOFF, 9))  # late handoff: no revival
    assert not ledger.accept(msg("r", MsgKind.NEW, 10))
    assert ledger.accept(msg("q", MsgKind.ABORT, 0))  # abort of an unseen rid
    assert not ledger.accept(msg("q", MsgKind.NEW, 1))


@settings(deadline=None)
@given(st.permutations(list(range(12))), st.integers(0, 11))
def test_ledger_acts_on_an_increasing_subsequence(order: list[int], finish_at: int) -> None:
    ledger = RequestLedger()
    acted: list[int] = []
    for seq in order:
        kind = MsgKind.FINISHED if seq == finish_at else MsgKind.HANDOFF
        if ledger.accept(msg("r", kind, seq)):
            acted.append(seq)
    handoffs = acted[:-1]  # the terminal message is accepted whatever its seq, then nothing
    assert handoffs == sorted(set(handoffs))
    assert acted[-1] == finish_at
    assert not ledger.accept(msg("r", MsgKind.HANDOFF, 99))


def test_ledger_finished_memory_is_bounded_lru() -> None:
    ledger = RequestLedger(finished_capacity=3)
    for rid in "abcd":
        ledger.accept(msg(rid, MsgKind.FINISHED, 0))
    assert not ledger.is_finished("a")  # evicted, oldest
    assert ledger.is_finished("b")
    ledger.accept(msg("b", MsgKind.HANDOFF, 1))  # a hit refreshes "b"
    ledger.accept(msg("e", MsgKind.FINISHED, 0))
    assert ledger.is_finished("b") and not ledger.is_finished("c")


def test_anchors_send_only_the_suffix_after_a_first_visit() -> None:
    prompt = [10, 11, 12, 13]
    anchors = Anchors()
    assert anchors.suffix_for("small", prompt) == (0, prompt)  # first visit: whole prompt
    anchors.advance("small", 4)
    sequence = [*prompt, 20, 21, 22]  # small decoded 3 tokens; its KV holds 4 + 2
    anchors.advance("small", 6)
    assert anchors.suffix_for("large", sequence) == (0, sequence)
    anchors.advance("large", len(sequence))
    sequence += [30]  # large decodes one
    assert anchors.suffix_for("small", sequence) == (6, [22, 30])
    assert anchors.suffix_for("medium", sequence) == (0, sequence)
    anchors.advance("medium", 8)
    sequence += [31, 32]
    for model, expected in [("small", 6), ("large", 7), ("medium", 8)]:
        anchor, tokens = anchors.suffix_for(model, sequence)
        assert (anchor, tokens) == (expected, sequence[expected:])
    assert anchors.as_dict() == {"small": 6, "large": 7, "medium": 8}


def test_anchors_move_forward_only_unless_rewound() -> None:
    anchors = Anchors({"small": 5})
    with pytest.raises(ValueError, match="move back"):
        anchors.advance("small", 4)
    anchors.rewind("small", 4)  # its token at position 4 was dropped
    assert anchors.get("small") == 4
    with pytest.raises(ValueError, match="within"):
        anchors.rewind("small", 5)
    with pytest.raises(ValueError, match="past the sequence end"):
        Anchors({"large": 9}).suffix_for("large", [1, 2, 3])


def test_commit_log_orders_by_position() -> None:
    log = CommitLog(start=3)
    assert log.add(3, [1, 2]) == [1, 2]
    assert log.add(7, [5, 6]) == []  # early: waits for 5..6
    assert log.add(3, [1, 2]) == []  # duplicate
    assert log.add(5, [3, 4]) == [3, 4, 5, 6]  # fills the gap, drains the early one
    assert log.add(6, [4, 5, 6, 7]) == [7]  # overlap
    assert log.tokens == [1, 2, 3, 4, 5, 6, 7] and log.end == 10 and log.num_waiting == 0
    with pytest.raises(ProtocolError, match="rewrites"):
        log.add(8, [0])
    with pytest.raises(ProtocolError, match="prompt"):
        log.add(1, [0])


def test_commit_log_keeps_each_tokens_writer_and_report() -> None:
    log, info = CommitLog(start=2), TokenInfo(score=0.5)
    assert log.add(2, [1], "small") == [1]
    assert log.add(4, [3, 4], "large", [info, info]) == []  # early: waits with its writer
    assert log.add(3, [2], "mid") == [2, 3, 4]
    assert log.add(3, [2, 3, 4, 5], "small", [info] * 4) == [5]  # overlap: new token only
    assert log.writers == ["small", "mid", "large", "large", "small"]
    assert log.infos == [None, None, info, info, info]
    assert log.add(8, [7], "x") == [] and log.settled().writers == log.writers
    assert log.settled().num_waiting == 0 and log.settled().tokens == log.tokens


@settings(deadline=None)
@given(st.lists(st.integers(1, 4), min_size=1, max_size=10), st.randoms())
def test_commit_log_any_arrival_order(sizes: list[int], rnd: object) -> None:
    chunks, pos, output = [], 0, []
    for size in sizes:
        chunk = list(range(pos, pos + size))
        chunks.append((pos, chunk))
        output += chunk
        pos += size
    arrivals = chunks + chunks[: len(chunks) // 2]  # with duplicates
    rnd.shuffle(arrivals)  # type: ignore[attr-defined]
    log = CommitLog(start=0)
    streamed = [t for anchor, chunk in arrivals for t in log.add(anchor, chunk)]
    assert streamed == output == log.tokens


def tiny_tokenizer(words: list[str], eos: str = "</s>") -> object:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", "<pad>", *words])}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
        bos_token="<s>",
        eos_token=eos,
        pad_token="<pad>",
        unk_token="[UNK]",
    )


def test_shared_tokenizer_accepts_equal() -> None:
    words = ["hello", "world", "token"]
    check_shared_tokenizer(
        {
            "small": tiny_tokenizer(words),
            "large": tiny_tokenizer(words),
            "mid": tiny_tokenizer(words),
        }
    )
    check_shared_tokenizer({"only": tiny_tokenizer(words)})


def test_shared_tokenizer_rejects_different_and_names_the_models() -> None:
    base = tiny_tokenizer(["hello", "world", "token"])
    cases = {
        "vocab size": tiny_tokenizer(["hello", "world", "token", "extra"]),
        "mappings differ": tiny_tokenizer(["world", "hello", "token"]),  # same size, swapped
        "eos_token_id": tiny_tokenizer(["hello", "world", "token"], eos="<pad>"),
    }
    for what, other in cases.items():
        with pytest.raises(ValueError, match=what) as info:
            check_shared_tokenizer({"qwen-0.6b": base, "ok": base, "qwen-32b": other})
        assert isinstance(info.value, TokenizerMismatchError)
        assert "'qwen-0.6b'" in str(info.value) and "'qwen-32b'" in str(info.value)


def test_by_destination_keeps_first_seen_order_and_message_order() -> None:
    def msg(rid: str, dst: str) -> PeerReq:
        return PeerReq(rid=rid, src="small/0", dst=dst, kind=MsgKind.COMMIT, handoff_seq=0)

    out = [msg("a", "ingress"), msg("b", "large/0"), msg("c", "ingress"), msg("d", "large/1")]
    groups = by_destination(out)
    assert list(groups) == ["ingress", "large/0", "large/1"]
    assert {dst: [m.rid for m in g] for dst, g in groups.items()} == {
        "ingress": ["a", "c"],
        "large/0": ["b"],
        "large/1": ["d"],
    }
    assert by_destination([]) == {}


def test_route_thresholds_travel_with_the_route_state_and_are_checked_on_decode() -> None:
    """A request's own routing threshold(s) ride in ``RouteState``; a frame with
    one outside [0, 1], NaN or not a number is refused, not run."""
    route = RouteState("ingress/0", 1, thresholds=(0.25, 1.0))
    spec = SamplingSpec(max_tokens=4)
    m = PeerReq("r", "ingress/0", "small/0", MsgKind.NEW, 0, [1], sampling=spec, route=route)
    assert decode(encode(m)).route.thresholds == (0.25, 1.0)
    assert decode(encode(msg("r", MsgKind.NEW, 0))).route is None
    for bad in (math.nan, 1.5, -0.1, math.inf):
        with pytest.raises(ValueError, match="thresholds"):
            RouteState("ingress/0", 1, thresholds=(bad,))
        raw = msgspec.msgpack.decode(encode(m))
        raw[11][-1] = [0.5, bad]
        with pytest.raises(ProtocolError, match="thresholds"):
            decode(msgspec.msgpack.encode(raw))
    raw = msgspec.msgpack.decode(encode(m))
    raw[11][-1] = ["high"]
    with pytest.raises(ProtocolError):
        decode(msgspec.msgpack.encode(raw))
