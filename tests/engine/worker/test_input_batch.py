"""A scheduled batch as the flat tensors of one forward pass, checked by hand:
a prefill chunk that does not reach the end of its prompt (no sample), a prompt
finished this step, and a decode, with blocks out of order."""
import torch

from cpuserve.core.sampling_params import SamplingParams
from cpuserve.core.scheduler import ScheduledBatch
from cpuserve.worker.input_batch import PromptRows, block_tables, prepare_inputs, prompt_logprob_rows, scoring_inputs


def seq(tokens, computed, table, params=None):
    from cpuserve.core.sequence import Sequence
    s = Sequence(list(tokens), params or SamplingParams())
    s.num_computed_tokens, s.block_table = computed, list(table)
    return s


def test_chunked_prefill_and_decode_in_one_step():
    bs = 4
    chunk = seq(range(100, 110), 0, [7, 3, 9])     # 10-token prompt, first 6 this step
    tail = seq(range(200, 206), 4, [5, 2])         # 6-token prompt, last 2 this step
    decode = seq([1, 2, 3, 4, 5], 4, [8, 6])       # one new token at position 4
    ids, ctx, samplers = prepare_inputs(ScheduledBatch([chunk, tail, decode], [6, 2, 1]), bs)
    assert ids.tolist() == [100, 101, 102, 103, 104, 105, 204, 205, 5]
    assert ctx.positions.tolist() == [0, 1, 2, 3, 4, 5, 4, 5, 4]
    # slot = block_table[pos // bs] * bs + pos % bs
    assert ctx.slot_mapping.tolist() == [28, 29, 30, 31, 12, 13, 8, 9, 24]
    assert ctx.query_start_loc.tolist() == [0, 6, 8, 9]
    assert ctx.seq_lens.tolist() == [6, 6, 5]
    assert ctx.logits_indices.tolist() == [7, 8]   # the chunk does not sample yet
    assert samplers == [tail, decode]
    assert ctx.block_tables.tolist() == [[7, 3, 9], [5, 2, 0], [8, 6, 0]]
    assert ctx.block_tables.dtype == torch.int32 and ctx.slot_mapping.dtype == torch.int64
    assert not ctx.every_token_samples


def test_prompt_logprob_rows_follow_the_samplers_logits():
    """Rows whose next token is a prompt token, of the sequences that ask for prompt logprobs: a
    chunk's every row, a finishing prompt's rows but its last (it samples), no decode row."""
    bs, ask = 4, SamplingParams(prompt_logprobs=1)
    chunk = seq(range(100, 110), 0, [7, 3, 9], ask)      # rows 0-5, positions 0-5
    plain = seq(range(300, 303), 0, [4])                 # rows 6-8: no prompt logprobs asked
    tail = seq(range(200, 206), 4, [5, 2], ask)          # rows 9-10, positions 4-5: 4 -> token 5
    decode = seq([1, 2, 3, 4, 5], 4, [8, 6], ask)        # row 11: a generated token's position
    decode.num_prompt_tokens = 4
    batch = ScheduledBatch([chunk, plain, tail, decode], [6, 3, 2, 1])
    assert prompt_logprob_rows(batch) == [PromptRows(chunk, 0, 0, 6), PromptRows(tail, 9, 4, 1)]
    _, ctx, samplers = prepare_inputs(batch, bs)
    assert samplers == [plain, tail, decode]
    assert ctx.logits_indices.tolist() == [8, 10, 11, 0, 1, 2, 3, 4, 5, 9]
    assert not ctx.every_token_samples


def test_block_tables_pad_with_zeros():
    assert block_tables([[1], [2, 3, 4]]).tolist() == [[1, 0, 0], [2, 3, 4]]


def test_scoring_inputs_take_logits_everywhere():
    ids, ctx = scoring_inputs([10, 11, 12, 13, 14], [6, 9], 4)
    assert ids.tolist() == [10, 11, 12, 13, 14]
    assert ctx.slot_mapping.tolist() == [24, 25, 26, 27, 36]
    assert ctx.logits_indices.tolist() == [0, 1, 2, 3, 4]
    assert ctx.query_start_loc.tolist() == [0, 5] and ctx.seq_lens.tolist() == [5]
    assert ctx.every_token_samples  # every row's logits, in order: no gather


def test_packed_whole_sequences_start_on_blocks_of_their_own():
    from cpuserve.worker.input_batch import blocks_for, packed_inputs
    ids, ctx = packed_inputs([[1, 2, 3, 4, 5], [6], [7, 8, 9, 10]], 4)
    assert ids.tolist() == list(range(1, 11))
    assert blocks_for([5, 1, 4], 4) == 4
    assert ctx.block_tables.tolist() == [[0, 1], [2, 0], [3, 0]]
    assert ctx.positions.tolist() == [0, 1, 2, 3, 4, 0, 0, 1, 2, 3]
    assert ctx.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 12, 13, 14, 15]
    assert ctx.query_start_loc.tolist() == [0, 5, 6, 10]
    assert ctx.seq_lens.tolist() == [5, 1, 4]
    assert ctx.logits_indices.tolist() == [4, 5, 9]   # each sequence's last token
    assert not ctx.every_token_samples
    assert packed_inputs([[1], [2], [3]], 4)[1].every_token_samples  # one token each: every row samples


def _same_inputs(got, want):
    """DecodeInputs' answer against prepare_inputs': every tensor equal; the kept block table may be
    wider (zero columns beyond the longest table)."""
    (gi, gc, gs), (wi, wc, ws) = got, want
    assert gi.tolist() == wi.tolist() and gs == ws
    assert gc.every_token_samples and wc.every_token_samples  # decode rows: the logits need no gather
    for name in ("positions", "slot_mapping", "seq_lens", "query_start_loc", "logits_indices"):
        g, w = getattr(gc, name), getattr(wc, name)
        assert g.dtype == w.dtype and g.tolist() == w.tolist(), name
    width = wc.block_tables.shape[1]
    assert gc.block_tables.dtype == torch.int32
    assert gc.block_tables[:, :width].tolist() == wc.block_tables.tolist()
    assert not gc.block_tables[:, width:].any()


def _advance(s, bs, free):
    """One decode step done: the sampled token appended, a new block when the next position needs one."""
    s.num_computed_tokens += 1
    s.token_ids.append(1000 + len(s.token_ids))
    if len(s.token_ids) > len(s.block_table) * bs:
        s.block_table.append(free.pop())


def test_decode_inputs_rewrite_in_place_what_prepare_inputs_builds():
    """Decode steps as the scheduler makes them: the same sequences step after step (the kept
    tensors are rewritten, not rebuilt), tables growing past the kept width, a block swapped for
    a cached one, a sequence leaving and one joining; each step's inputs equal prepare_inputs'."""
    from cpuserve.worker.input_batch import DecodeInputs
    bs = 4
    free = list(range(100, 400))
    a = seq(range(10, 17), 6, [1, 2])     # 7 tokens, the last not yet computed
    b = seq(range(20, 24), 3, [3])
    c = seq(range(30, 39), 8, [4, 5, 6])
    dec = DecodeInputs(bs)
    batch, kept = [a, b], None
    for step in range(90):
        if step == 30:
            a.block_table[0] = 77          # a full block replaced (the prefix cache's copy)
        if step == 50:
            batch = [b, c]                 # a leaves, c joins
        got = dec(ScheduledBatch(list(batch), [1] * len(batch)))
        _same_inputs(got, prepare_inputs(ScheduledBatch(list(batch), [1] * len(batch)), bs))
        if step not in (0, 50) and kept is not None and got[1].block_tables.shape == kept.block_tables.shape:
            assert got[1] is kept          # the same tensors, rewritten
        kept = got[1]
        for s in batch:
            _advance(s, bs, free)
    assert len(b.block_table) > DecodeInputs.HEADROOM + 1  # the kept table was laid out wider on the way


def test_decode_inputs_leave_prompts_to_prepare_inputs():
    from cpuserve.worker.input_batch import DecodeInputs
    dec = DecodeInputs(4)
    prompt = seq(range(10), 0, [1, 2, 3])
    assert dec(ScheduledBatch([prompt], [10])) is None             # a prefill
    chunk = seq(range(10), 8, [1, 2, 3])
    assert dec(ScheduledBatch([chunk], [1])) is None               # one prompt token that does not sample
    assert dec(ScheduledBatch([], [])) is None
