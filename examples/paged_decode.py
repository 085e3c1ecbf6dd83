"""Greedy decoding with a paged KV cache: prefill and decode steps through one program.

A small causal decoder (grouped-query attention, rotary-free for brevity) generates tokens for a
batch of prompts of different lengths, the way vLLM's TPU backend does on PyTorch/XLA: every
step takes a flat batch of new tokens (the prompts at first, then one token per sequence), writes
their keys and values into pages of a shared cache (``index_copy_``), and attends with
``ragged_paged_attention``. Which tokens belong to which sequence, the sequences' lengths and
their pages are tensors, so every step, prefill or decode, is the same program: it compiles once.

The tokens are checked against the same model run on eager CPU over each sequence's whole history
(no cache); the script exits non-zero if any token differs, the logits differ beyond 1e-4, or
the loop compiles more than once.

Run: python examples/paged_decode.py [--new-tokens 6]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_torch
import spmd_torch.debug.metrics as met
from spmd_torch.experimental.custom_kernel import ragged_paged_attention

VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 97, 64, 4, 2, 2
HEAD_DIM = DIM // HEADS
PAGE_SIZE, PAGES_PER_SEQUENCE, POOL_PAGES = 4, 8, 40
MAX_TOKENS = 32  # new tokens a step takes, padded: prefill and decode steps alike


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, HEADS * HEAD_DIM)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM)
        self.out = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def projections(self, x):
        """q [tokens, heads, dim] and k, v [tokens, kv_heads, dim] of the normalised input."""
        h = self.norm1(x)
        k, v = self.kv(h).view(-1, 2, KV_HEADS, HEAD_DIM).unbind(1)
        return self.q(h).view(-1, HEADS, HEAD_DIM), k, v

    def finish(self, x, attended):
        x = x + self.out(attended.reshape(x.shape[0], DIM))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def step(self, tokens, slots, caches, kv_lens, page_indices, cu_q_lens, num_seqs):
        """Logits of a flat batch of new tokens; each layer's keys and values are written to the
        cache slots of the tokens' positions first."""
        x = self.embed(tokens)
        for layer, cache in zip(self.layers, caches):
            q, k, v = layer.projections(x)
            interleaved = torch.stack([k, v], dim=2).reshape(-1, 2 * KV_HEADS, HEAD_DIM)
            cache.view(-1, 2 * KV_HEADS, HEAD_DIM).index_copy_(0, slots, interleaved)
            attended = ragged_paged_attention(
                q, cache, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale=HEAD_DIM**-0.5
            )
            x = layer.finish(x, attended)
        return self.head(x)

    def full(self, tokens):
        """Logits of one sequence's whole history with causal attention, no cache (the check)."""
        x = self.embed(tokens)
        for layer in self.layers:
            q, k, v = (t.transpose(0, 1) for t in layer.projections(x))
            attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = layer.finish(x, attended.transpose(0, 1))
        return self.head(x)


class PagedBatch:
    """The step's index tensors for sequences of known lengths: the new tokens of sequence ``s``
    are rows ``cu_q_lens[s]:cu_q_lens[s + 1]``, at positions up to ``kv_lens[s] - 1``; sequence
    ``s`` owns pages ``s * PAGES_PER_SEQUENCE`` on, in reverse order (any order works)."""

    def __init__(self, sequences: int, device):
        self.device = device
        pages = torch.arange(sequences * PAGES_PER_SEQUENCE, dtype=torch.int32)
        self.page_indices = pages.view(sequences, PAGES_PER_SEQUENCE).flip(1)

    def tensors(self, lengths: list[int], new: list[int]) -> tuple:
        """(slots, kv_lens, page_indices, cu_q_lens, num_seqs) on the device: ``new[s]`` tokens
        of sequence ``s`` whose history becomes ``lengths[s]`` long."""
        slots, cu_q_lens = [], [0]
        for s, (length, count) in enumerate(zip(lengths, new)):
            for position in range(length - count, length):
                page = int(self.page_indices[s, position // PAGE_SIZE])
                slots.append(page * PAGE_SIZE + position % PAGE_SIZE)
            cu_q_lens.append(cu_q_lens[-1] + count)
        padding = MAX_TOKENS - len(slots)  # padding rows write a page no sequence owns
        slots += [(POOL_PAGES - 1) * PAGE_SIZE] * padding
        values = (slots, lengths, self.page_indices, cu_q_lens, [len(lengths)])
        return tuple(torch.as_tensor(v, dtype=torch.int32).to(self.device) for v in values)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=6)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in (5, 9, 3)]
    model = Decoder().eval()
    device = spmd_torch.device()
    on_device = Decoder().eval()
    on_device.load_state_dict(model.state_dict())
    on_device.to(device)
    caches = [
        torch.zeros(POOL_PAGES, PAGE_SIZE, 2 * KV_HEADS, HEAD_DIM, device=device)
        for _ in range(LAYERS)
    ]
    batch = PagedBatch(len(prompts), device)
    histories = [list(p) for p in prompts]
    new = [list(p) for p in prompts]  # the prefill: every prompt token is new
    worst = 0.0
    met.clear_all()
    with torch.no_grad():
        for step in range(args.new_tokens):
            lengths = [len(h) for h in histories]
            tokens = [t for seq in new for t in seq]
            tokens = torch.tensor(tokens + [0] * (MAX_TOKENS - len(tokens))).to(device)
            slots, *index = batch.tensors(lengths, [len(n) for n in new])
            logits = on_device.step(tokens, slots, caches, *index)
            spmd_torch.sync()  # the step's program: the logits and every layer's cache written
            last = torch.tensor([sum(len(n) for n in new[: s + 1]) - 1 for s in range(len(new))])
            logits = logits.cpu()[last]
            for s, history in enumerate(histories):
                expected = model.full(torch.tensor(history))[-1]
                worst = max(worst, (logits[s] - expected).abs().max().item())
                token = int(logits[s].argmax())
                if token != int(expected.argmax()):
                    print(f"MISMATCH at step {step}, sequence {s}: {token}")
                    return 1
                history.append(token)
            new = [[h[-1]] for h in histories]
            print(f"step {step}: tokens {[h[-1] for h in histories]}")
    compiles = met.metric_data("CompileTime")[0] if met.metric_data("CompileTime") else 0
    print(f"generated {args.new_tokens} tokens for {len(prompts)} sequences")
    print(f"largest logit difference from eager CPU {worst:.2e}; compilations {compiles}")
    if worst > 1e-4 or compiles > 1:
        print("FAILED")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
