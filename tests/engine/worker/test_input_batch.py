"""A scheduled batch as the flat tensors of one forward pass, checked by hand:
a prefill chunk that does not reach the end of its prompt (no sample), a prompt
finished this step, and a decode, with blocks out of order."""
import torch

from cpuserve.core.sampling_params import SamplingParams
from cpuserve.core.scheduler import ScheduledBatch
from cpuserve.worker.input_batch import block_tables, prepare_inputs, scoring_inputs


def seq(tokens, computed, table):
    from cpuserve.core.sequence import Sequence
    s = Sequence(list(tokens), SamplingParams())
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


def test_block_tables_pad_with_zeros():
    assert block_tables([[1], [2, 3, 4]]).tolist() == [[1, 0, 0], [2, 3, 4]]


def test_scoring_inputs_take_logits_everywhere():
    ids, ctx = scoring_inputs([10, 11, 12, 13, 14], [6, 9], 4)
    assert ids.tolist() == [10, 11, 12, 13, 14]
    assert ctx.slot_mapping.tolist() == [24, 25, 26, 27, 36]
    assert ctx.logits_indices.tolist() == [0, 1, 2, 3, 4]
    assert ctx.query_start_loc.tolist() == [0, 5] and ctx.seq_lens.tolist() == [5]


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
