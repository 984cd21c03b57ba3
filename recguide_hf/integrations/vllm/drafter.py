"""recguide-hf's draft step for requests that another engine verifies (vLLM's proposer, `proposer.py`).

`ShadowDrafter` keeps its own copy of the self-speculative model with one KV-cache row per request and, each step,
is handed every request's token ids as the verifying engine has them (prompt and output; the last one is the seed
the engine has not run yet). It

1. reads each request's last round off its tokens: how many of the drafts it proposed were accepted (the tokens
   after the old seed that equal its drafts, the last new token being the verifier's bonus);
2. brings its cache up to the seed (one causal forward, the drafting adapter off: the verifier's own keys, whose
   logits also give the verifier entropy over the verified places, the signal the value table reads);
3. picks each request's block size B (LinearSS: the fixed one; RecGuide auto: `core.policy.BlockPolicy`, fed the
   same `RoundOutcome`s as in the engine) and drafts `[seed, MASK x (B - 1)]` as the engine does
   (`Engine._draft`: the folder's `recguide_first_draft` layout, the drafting adapter on the draft tokens only);
   the draft's slots are scratch, overwritten by the next step's causal forward.

Whatever it drafts, the verifying engine's greedy output is its own: drafts only change how many forwards it takes.
Requests are matched to cache rows by their tokens (a row whose tokens start the request's), so the verifying
engine need not say which request is which; a row unmatched in a step is freed (its request finished, or was
preempted and is prefilled again when it comes back).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from ...core.config import PAPER_BLOCK_SIZES, DecodingConfig
from ...core.draft import draft_layout, draft_logits_of, make_draft, mask_out
from ...core.masks import build_mask, causal_intra, positions
from ...core.policy import BlockPolicy, RoundOutcome, cost_table_of
from ...models.registry import as_backbone


@dataclass
class RequestStats:
    """One request's drafting rounds so far (tau = (accepted + rounds) / rounds: tokens per verify forward)."""

    rounds: int = 0  # verify forwards that carried drafts
    drafted: int = 0
    accepted: int = 0
    plain: int = 0  # steps without drafts (B = 1)

    @property
    def tau(self) -> float:
        return (self.accepted + self.rounds) / self.rounds if self.rounds else float("nan")


class ShadowDrafter:
    """Drafts for up to `slots` requests at once; `step` takes their token ids, returns their drafts.

    Args:
        model: the folder's self-speculative model (its drafting adapter attached; `from_pretrained`).
        config: the folder's decoding settings (`DecodingConfig.from_sources`): mode "ar" drafts nothing, "linear"
            the fixed `block_size`, "recguide" with `block_size="auto"` per request from `core.policy`.
        max_drafts: the most drafts a request may get (vLLM's `num_speculative_tokens`): B <= max_drafts + 1.
        capacity: KV slots per row (the verifying engine's max model length).
        base_dir: where the config's cost and value tables are (the model folder).
    """

    def __init__(self, model, config: DecodingConfig, slots: int, max_drafts: int, capacity: int, base_dir=None):
        self.backbone = as_backbone(model)
        self.mask_id = self.backbone.mask_token_id
        self.config, self.max_drafts, self.capacity = config, max_drafts, capacity
        self.cache = self.backbone.new_cache(slots, capacity + 1)  # + the seed of a block at the very end
        self.committed = [np.zeros(0, dtype=np.int64) for _ in range(slots)]  # the tokens each row's cache holds
        # its request's tokens at its last step (the last one that step's seed; empty: no step yet)
        self.seen = [np.zeros(0, dtype=np.int64) for _ in range(slots)]
        self.in_use = [False] * slots
        self.proposed: list[list[int]] = [[] for _ in range(slots)]  # the drafts each row got last step (B - 1)
        self.stats = [RequestStats() for _ in range(slots)]
        self.finished: list[RequestStats] = []  # rows freed since `take_finished`
        self.policy = None
        if config.mode == "recguide" and config.block_size == "auto":
            config = _within(config, max_drafts + 1, base_dir)
            self.policy = BlockPolicy.from_config(config, base_dir)
            self.policy.start(slots)

    @property
    def fixed_block(self) -> int:
        if self.config.mode == "ar":
            return 1
        return min(int(self.config.block_size), self.max_drafts + 1)

    # ------------------------------------------------------------------ one step
    @torch.no_grad()
    def step(self, requests: list[np.ndarray | None]) -> list[list[int]]:
        """Drafts per request (`[]`: none). `requests[i]`: request i's token ids (the last one is its seed), or None
        where it takes no draft this step (a prompt still being prefilled)."""
        rows = self._assign(requests)
        live = [(i, r) for i, r in enumerate(rows) if r is not None]
        drafts: list[list[int]] = [[] for _ in requests]
        if not live:
            return drafts
        pairs = [(r, requests[i]) for i, r in live]
        accepted = {r: self._accepted(r, t) for r, t in pairs if self.proposed[r]}
        # rows that drafted last step: their cache up to the seed (and the verifier's entropy over what it verified)
        entropy = self._sync([(r, t) for r, t in pairs if r in accepted], windows=accepted)
        self._observe(pairs, accepted, entropy)
        blocks = self._blocks([r for _, r in live], [len(requests[i]) for i, _ in live])
        # rows drafting now catch up to their seeds; a row on plain steps (B = 1) runs no forward here at all
        self._sync([(r, t) for (r, t), b in zip(pairs, blocks) if b >= 2])
        for block in sorted(set(blocks)):
            if block < 2:
                continue
            group = [(i, r) for (i, r), b in zip(live, blocks) if b == block]
            ids = self._draft([r for _, r in group], [int(requests[i][-1]) for i, _ in group], block)
            for (i, _r), d in zip(group, ids):
                drafts[i] = d
        for (i, r), b in zip(live, blocks):
            self.proposed[r] = drafts[i]
            self.seen[r] = requests[i]
            if b < 2:
                self.stats[r].plain += 1
        return drafts

    def take_finished(self) -> list[RequestStats]:
        """The stats of requests whose rows were freed since the last call."""
        done, self.finished = self.finished, []
        return done

    # ------------------------------------------------------------------ rows
    def _assign(self, requests: list[np.ndarray | None]) -> list[int | None]:
        """The cache row of each request. A row goes on with the request whose tokens extend the ones it saw last step
        by at most one round (accepted drafts and the bonus token); rows no request goes on with are freed; a request
        without a row takes the free row whose cache holds the longest start of its tokens (a follow-up turn reuses
        what it can), as a new request."""
        rows: list[int | None] = [None] * len(requests)
        taken: set[int] = set()
        waiting = [i for i, t in enumerate(requests) if t is not None]
        for i in sorted(waiting, key=lambda i: -len(requests[i])):
            tokens = requests[i]
            for r, seen in enumerate(self.seen):
                n = seen.shape[0]
                if (self.in_use[r] and r not in taken and n < tokens.shape[0] <= n + self.max_drafts + 1
                        and np.array_equal(seen, tokens[:n])):
                    rows[i] = r
                    taken.add(r)
                    break
        for r in range(len(self.in_use)):
            if self.in_use[r] and r not in taken:
                self._free(r)
        for i in waiting:
            if rows[i] is not None:
                continue
            tokens = requests[i]
            free = [r for r in range(len(self.in_use)) if not self.in_use[r]]
            if not free:
                raise RuntimeError(f"more requests than the drafter's {len(self.in_use)} rows")
            kept = {r: _common_prefix(self.committed[r], tokens[:-1]) for r in free}
            r = max(free, key=kept.__getitem__)
            self._start(r, kept[r])
            rows[i] = r
        return rows

    def _start(self, r: int, keep: int = 0):
        """Row r takes a new request; its cache keeps its first `keep` tokens (a start the request shares)."""
        self.in_use[r] = True
        self.committed[r] = self.committed[r][:keep]
        self.seen[r] = np.zeros(0, dtype=np.int64)
        self.proposed[r] = []
        self.stats[r] = RequestStats()
        self.cache.reset_rows(torch.tensor([r]))
        self.cache.commit(torch.tensor([r]), torch.tensor([keep]))
        if self.policy is not None:
            self.policy.reset_rows(torch.tensor([r]))

    def _free(self, r: int):
        """The row's request left; its cache stays, for a request that starts alike (`_assign`)."""
        self.finished.append(self.stats[r])
        self.in_use[r] = False
        self.proposed[r] = []

    # ------------------------------------------------------------------ the cache up to each seed
    def _sync(self, live: list[tuple[int, np.ndarray]], windows: dict[int, int] | None = None) -> dict[int, float]:
        """Encode each row's tokens after its cache up to (not including) the seed, causally, the drafting adapter
        off. With `windows` (row -> drafts accepted in its last round) and a policy that reads it: the mean verifier
        entropy over each such row's verified places (its old seed and accepted drafts), as `verifier_entropy`."""
        wants = windows is not None and self.policy is not None and self.policy.reads_entropy
        entropy: dict[int, float] = {}
        todo = []
        for r, tokens in live:
            held = self.committed[r].shape[0]
            if held > tokens.shape[0] - 1 or not np.array_equal(self.committed[r], tokens[:held]):
                raise AssertionError("a row's cache is not a prefix of its request")  # _assign matched it so
            if tokens.shape[0] - 1 > held:
                todo.append((r, tokens[held:-1]))
        # rows catching up together share one forward, padded to the longest catch-up: a group must fit every row's
        # cache and that width (else its rows go one by one); a prompt (nothing cached yet) goes alone
        going = [(r, t) for r, t in todo if self.committed[r].shape[0] > 0]
        fits = bool(going) and (max(self.committed[r].shape[0] for r, _ in going) + max(t.shape[0] for _, t in going)
                                <= self.cache.capacity)
        together = {r for r, _ in going} if fits else set()
        groups = [[(r, t)] for r, t in todo if r not in together] + ([going] if fits else [])
        for group in groups:
            logits = self._causal(group, keep_logits=wants and any(r in windows for r, _ in group))
            for k, (r, new) in enumerate(group):
                self.committed[r] = np.concatenate([self.committed[r], new])
                if logits is not None and r in windows:
                    n = min(new.shape[0], windows[r] + 1)
                    scores = mask_out(logits[k, :n].float(), [self.mask_id])
                    logp = torch.log_softmax(scores, dim=-1)
                    entropy[r] = float(-(logp.exp() * logp).nan_to_num().sum(-1).mean())
        return entropy

    def _causal(self, group: list[tuple[int, np.ndarray]], keep_logits: bool) -> torch.Tensor | None:
        device = self.backbone.device
        rows = torch.tensor([r for r, _ in group], device=device)
        counts = torch.tensor([t.shape[0] for _, t in group])
        q = int(counts.max())
        ids = torch.zeros(len(group), q, dtype=torch.long)
        for k, (_, t) in enumerate(group):
            ids[k, : t.shape[0]] = torch.from_numpy(t)
        ids = ids.to(device)
        valid = (torch.arange(q)[None, :] < counts[:, None]).to(device)
        intra = causal_intra(len(group), q, device) & valid[:, None, :]
        offsets = torch.arange(q, device=device).expand(len(group), -1)
        logits = self._forward(rows, ids, offsets, intra, draft_mask=None, logits_to_keep=0 if keep_logits else 1)
        self.cache.commit(rows, counts)
        return logits if keep_logits else None

    # ------------------------------------------------------------------ outcomes and block sizes
    def _accepted(self, r: int, tokens: np.ndarray) -> int:
        """Drafts of row r's last round the verifier accepted: the tokens after the old seed that equal them (the
        last new token is the verifier's own, the bonus; vLLM may have verified fewer drafts than proposed)."""
        drafts = self.proposed[r]
        new = tokens[self.seen[r].shape[0]:].tolist()  # after the old seed, the last token the row saw
        n = 0
        while n < min(len(drafts), len(new) - 1) and new[n] == drafts[n]:
            n += 1
        return n

    def _observe(self, live: list[tuple[int, np.ndarray]], accepted: dict[int, int], entropy: dict[int, float]):
        """Each row's last round as a `RoundOutcome` for the policy (plain steps too), and the request's stats."""
        by_block: dict[int, list[tuple[int, int, int]]] = {}
        for r, _ in live:
            drafts = self.proposed[r]
            if not drafts:
                if self.seen[r].shape[0]:  # a plain step (B = 1): nothing drafted, nothing to accept
                    by_block.setdefault(1, []).append((r, 0, 0))
                continue
            s = self.stats[r]
            s.rounds, s.drafted, s.accepted = s.rounds + 1, s.drafted + len(drafts), s.accepted + accepted[r]
            by_block.setdefault(len(drafts) + 1, []).append((r, accepted[r], len(drafts)))
        if self.policy is None:
            return
        for block, items in by_block.items():
            rows = torch.tensor([r for r, _, _ in items])
            ent = torch.tensor([entropy.get(r, float("nan")) for r, _, _ in items]) if entropy and block > 1 else None
            self.policy.observe(RoundOutcome(rows, block, torch.tensor([a for _, a, _ in items]),
                                             torch.tensor([d for _, _, d in items]), ent))

    def _blocks(self, rows: list[int], lengths: list[int]) -> list[int]:
        if self.policy is not None:
            t = torch.tensor(rows)
            blocks = self.policy.plan(t, torch.zeros(len(self.in_use), dtype=torch.bool)).tolist()
        else:
            blocks = [self.fixed_block] * len(rows)
        # never past the verifying engine's length: vLLM schedules at most max_model_len - n - 1 drafts
        return [max(1, min(b, self.capacity - n)) for b, n in zip(blocks, lengths)]

    # ------------------------------------------------------------------ the draft forward
    def _draft(self, rows: list[int], seeds: list[int], block: int) -> list[list[int]]:
        """The engine's draft forward (`core.draft.draft_layout`) for rows of one block size after each row's cache."""
        device = self.backbone.device
        rows_t = torch.tensor(rows, device=device)
        width = torch.full((len(rows),), block, device=device)
        ids, intra, offsets, draft_mask = draft_layout(torch.tensor(seeds, device=device), width, block, self.mask_id,
                                                       self.config.first_draft)
        logits = self._forward(rows_t, ids, offsets, intra, draft_mask=draft_mask)
        draft_logits = draft_logits_of(logits, self.config.first_draft)
        return make_draft(draft_logits, self.mask_id, [], None, with_risk=False).ids.tolist()

    def _forward(self, rows, ids, offsets, intra, draft_mask=None, logits_to_keep=0):
        binding = self.cache.prepare(rows, ids.shape[1])
        lengths = self.cache.lengths[rows.cpu()].to(ids.device)
        pads = torch.zeros_like(lengths)
        mask = build_mask(lengths, pads, intra, binding.kv_len, dtype=self.backbone.dtype)
        self.cache.use(binding)
        return self.backbone.forward(ids, positions(lengths, pads, offsets), mask, self.cache,
                                     draft_mask=draft_mask, logits_to_keep=logits_to_keep)


def _within(config: DecodingConfig, max_block: int, base_dir) -> DecodingConfig:
    """The config with RecGuide's candidate block sizes cut to those the verifying engine takes (<= max_block)."""
    candidates = config.block_sizes
    if candidates is None:
        costs = cost_table_of(config, base_dir)
        candidates = costs.block_sizes if costs is not None else PAPER_BLOCK_SIZES
    kept = tuple(b for b in candidates if b <= max_block) or (1,)
    return dataclasses.replace(config, block_sizes=kept)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.shape[0], b.shape[0])
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
