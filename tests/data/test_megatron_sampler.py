"""jaxtrain's cyclic order over Megatron's GPT datasets side by side with Megatron-LM's own
``MegatronPretrainingRandomSampler`` (data_sharding false; with one data-parallel rank also
true), across epochs and from a resumed position; and torch's CPU randperm, which that sampler
draws, reproduced with numpy."""
import types

import numpy as np
import pytest

from jaxtrain.data.batches import TokenData, global_batches, torch_randperm
from tests.megatron_ref import megatron_samplers

T = 4


def test_torch_randperm_with_numpy():
    torch = pytest.importorskip("torch")
    for seed in (0, 1, 2, 7, 12345, 2**32 + 3):
        for n in (0, 1, 2, 3, 10, 97, 1000, 65_537):
            g = torch.Generator()
            g.manual_seed(seed)
            want = torch.randperm(n, generator=g).numpy()
            np.testing.assert_array_equal(torch_randperm(n, seed), want, err_msg=f"{n} {seed}")


class Ids:
    """A dataset whose sample i is T + 1 copies of i (its id reads back from any token)."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(T + 1, int(i), np.int32)


def megatron_stream(sampler_cls, n, mbs, dp, rank, consumed, count, sharding):
    """The first ``count`` microbatches (lists of sample ids) Megatron's sampler gives
    ``rank``, re-iterated at each epoch's end as Megatron's cyclic iterator does."""
    sampler = sampler_cls(Ids(n), total_samples=n, consumed_samples=consumed,
                          micro_batch_size=mbs, data_parallel_rank=rank,
                          data_parallel_size=dp, data_sharding=sharding)
    out = []
    while len(out) < count:
        got = 0
        for batch in sampler:
            out.append(list(batch))
            got += 1
            if len(out) == count:
                break
        assert got, "the sampler gave nothing"
    return out


@pytest.mark.parametrize("n,mbs,dp,micro,sharding", [
    (37, 2, 1, 2, True), (37, 2, 1, 3, False), (40, 4, 1, 1, True),
    (37, 2, 2, 2, False), (50, 3, 2, 1, False), (61, 2, 3, 2, False),
])
def test_cyclic_order_is_megatrons_random_sampler(n, mbs, dp, micro, sharding):
    samplers = megatron_samplers()
    gbs = mbs * dp * micro
    steps = (3 * n) // gbs + 2                        # across three epochs and more
    tcfg = types.SimpleNamespace(micro_batch_size=mbs, data_parallel_size=dp,
                                 global_batch_size=gbs)
    data = TokenData(Ids(n), 1 << 20, "ids", dataloader_type="cyclic", megatron_order=True)
    for start in (0, 5):                              # from the start, and resumed at step 5
        consumed = start * gbs
        ranks = [megatron_stream(samplers.MegatronPretrainingRandomSampler, n, mbs, dp, r,
                                 consumed, steps * micro, sharding) for r in range(dp)]
        it = global_batches(data, tcfg, seed=0, consumed=consumed)
        for s in range(steps):
            tokens = next(it)["tokens"]               # [micro, mbs * dp, T]
            for m in range(micro):
                for r in range(dp):
                    mine = tokens[m, r * mbs:(r + 1) * mbs, 0].tolist()
                    assert mine == ranks[r][s * micro + m], (start, s, m, r)
        it.close()


def test_a_seed_of_its_own_keeps_the_grain_shuffle():
    """Data with an order seed of its own (pgs data.seed, MaxText data_shuffle_seed) keep the
    seeded grain shuffle; so do sources that are not Megatron's GPT datasets."""
    tcfg = types.SimpleNamespace(micro_batch_size=2, data_parallel_size=1, global_batch_size=4)

    def first(data):
        return next(global_batches(data, tcfg, seed=0))["tokens"][..., 0].ravel().tolist()

    megatron = TokenData(Ids(37), 1 << 20, "ids", megatron_order=True)
    seeded = TokenData(Ids(37), 1 << 20, "ids", megatron_order=True, seed=0)
    plain = TokenData(Ids(37), 1 << 20, "ids")
    assert first(seeded) == first(plain) != first(megatron)
    assert first(megatron) == torch_randperm(36, 0)[:4].tolist()
