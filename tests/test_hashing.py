"""Block hash ids: chains of consecutive ids against a plain key-per-block interning."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.kv.hashing import BlockHasher, _derived_from
from kvsim.request import ExplicitTokens, Request, RequestSpec, SegmentTokens, block_content


class Reference:
    """Every full block's key ``(parent id, content)`` interned on its own, ids in order."""

    def __init__(self, block_size: int, lookahead: int):
        self.b, self.la, self.ids = block_size, lookahead, {}

    def hashes(self, req: Request, num_blocks: int) -> list[int]:
        b, la = self.b, self.la
        n = min(num_blocks, (req.num_tokens - la) // b)
        out, parent = [], None
        for i in range(n):
            key = (parent, block_content(req.token_window(i * b, (i + 1) * b + la)))
            parent = self.ids.setdefault(key, len(self.ids))
            out.append(parent)
        return out


def _request(prompt, seq: int, outputs: int) -> Request:
    r = Request(RequestSpec(f"r{seq}", 0.0, prompt, 1 << 20), seq)
    r.num_output_tokens = outputs
    return r


@st.composite
def workloads(draw):
    """Prompts made of a few shared runs, given as segments or as explicit ids (the same ids
    either way), some with outputs; each hashed in one to three calls."""
    runs = [(draw(st.integers(0, 3)) * 1000, draw(st.integers(1, 60))) for _ in range(4)]
    reqs = []
    for _ in range(draw(st.integers(1, 12))):
        segs = draw(st.lists(st.sampled_from(runs), min_size=1, max_size=3))
        if draw(st.booleans()):  # a run cut short, so prompts diverge inside a run
            first, length = segs[-1]
            segs[-1] = (first, draw(st.integers(1, length)))
        if draw(st.booleans()):
            prompt = SegmentTokens(segs)
        else:
            prompt = ExplicitTokens(tuple(t for f, n in segs for t in range(f, f + n)))
        calls = sorted(draw(st.lists(st.integers(0, 40), min_size=1, max_size=3)))
        reqs.append((prompt, draw(st.sampled_from([0, 0, 3, 17])), calls))
    return (draw(st.sampled_from([1, 2, 4, 16])), draw(st.sampled_from([0, 0, 1, 3])), reqs)


@settings(max_examples=300, deadline=None)
@given(workloads(), st.booleans())
def test_ids_are_equal_exactly_when_whole_prefixes_are(case, shared_outputs):
    """Against one interned key per block: one id per distinct prefix and one prefix per id,
    for each request's own output tokens or for outputs all alike (a replay's default -1);
    an interned id stands for its blocks' contents."""
    block_size, lookahead, reqs = case
    hasher, ref = BlockHasher(block_size, lookahead), Reference(block_size, lookahead)
    to_ref, from_ref = {}, {}
    for seq, (prompt, outputs, calls) in enumerate(reqs):
        r = _request(prompt, seq, outputs)
        if shared_outputs:
            r.output_token_id = -1
        for num_blocks in calls:
            got = list(hasher.block_hashes(r, num_blocks))
            want = ref.hashes(r, max(num_blocks, len(got)))
            assert len(got) == len(want)
            for h, w in zip(got, want):
                assert to_ref.setdefault(h, w) == w and from_ref.setdefault(w, h) == h
    key = {w: k for k, w in ref.ids.items()}

    def prefix(w):
        parent, content = key[w]
        return (prefix(parent) if parent is not None else ()) + (content,)

    held = hasher.contents(to_ref)
    for h, w in to_ref.items():
        if h >= 0:
            assert held[h] == prefix(w)


@settings(max_examples=200, deadline=None)
@given(workloads(), st.data())
def test_after_dropping_unused_ids_equal_blocks_still_get_equal_ids(case, data):
    """Ids held stay (with their ancestors); any ids made afterwards are equal exactly when
    the blocks' whole prefixes are, and never an id dropped before."""
    block_size, lookahead, reqs = case
    hasher = BlockHasher(block_size, lookahead)
    first = []
    for seq, (prompt, outputs, calls) in enumerate(reqs):
        r = _request(prompt, seq, outputs)
        first.append(list(hasher.block_hashes(r, calls[-1])))
    held = data.draw(st.lists(st.integers(0, len(reqs) - 1), unique=True))
    live = {h for i in held for h in first[i]}
    made = hasher._next
    hasher.forget_all_but(live)
    kept = set(hasher.contents())  # interned ids kept
    assert live <= set(hasher.contents(live))  # and every live id's origin
    again = Reference(block_size, lookahead)
    seen: dict[int, tuple] = {}
    for seq, (prompt, outputs, calls) in enumerate(reqs):
        r = _request(prompt, len(reqs) + seq, outputs)
        r.output_token_id = -(seq + 1)  # the same outputs as the first time
        got = hasher.block_hashes(r, calls[-1])
        if seq in held:
            assert got == first[seq]
        for h, key in zip(got, again.hashes(r, calls[-1])):
            assert seen.setdefault(h, key) == key  # one id, one prefix
            root = h if h >= 0 else _derived_from(h)[0]
            assert root in kept or root >= made
    assert len(set(seen.values())) == len(seen)  # one prefix, one id


def test_a_prompt_of_one_run_costs_one_key():
    hasher = BlockHasher(16)
    r = _request(SegmentTokens([(0, 100_000)]), 0, 0)
    assert hasher.block_hashes(r, 1 << 30) == list(range(6250))
    assert len(hasher) == 2  # one key, one chain (a range)
    # The same ids given one by one walk the chain; a prompt leaving it mid-way branches off.
    same = _request(ExplicitTokens(tuple(range(64))), 1, 0)
    assert hasher.block_hashes(same, 4) == [0, 1, 2, 3]
    branch = _request(SegmentTokens([(0, 40), (7, 24)]), 2, 0)
    assert hasher.block_hashes(branch, 4) == [0, 1, 6250, 6251]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3).map(lambda a: a * 1000), st.integers(1, 40)),
                min_size=1, max_size=5), st.data())
def test_segment_block_contents_are_each_windows_canonical_form(segs, data):
    """``SegmentTokens.block_contents`` (runs of windows taken whole) against each window's
    ``block_content`` one by one."""
    prompt = SegmentTokens(segs)
    size = data.draw(st.integers(1, min(20, len(prompt))))
    step = data.draw(st.integers(1, 20))
    first = data.draw(st.integers(0, len(prompt) - size))
    count = data.draw(st.integers(1, (len(prompt) - size - first) // step + 1))
    want = [block_content(prompt.window(s, s + size)) for s in range(first, first + count * step, step)]
    assert list(prompt.block_contents(first, count, step, size)) == want
