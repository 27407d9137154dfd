#!/usr/bin/env python3
"""Train kvdiag's shipped tiny model (kvdiag/assets/tiny-llama) on synthetic key-value recall.

Each training sequence is ``<s>`` + n pairs ``kmbt=0932`` + `` ;`` + q queries
`` kmbt=0932`` (format: kvdiag/tasks/recall.py). The loss is on each queried
value's digits and on its key's 2nd..4th letters and '=' (copying those from the
context teaches the multi-token matching that recall needs); keys and first-seen
values are random and not trained on. The pair count follows a curriculum:
n ~ U[--min-pairs, n_max]; n_max starts at --start-pairs and grows x1.3 (up to
--max-pairs) each time the running accuracy on a value's first digit (the one
only the key can tell) passes --promote-at. Starting from 2-4 pairs is what
makes recall emerge quickly. A third of the queries are drawn from the first 15%
of the pairs so that early keys are recalled too. Keys reserved for the shipped
tasks (recall.is_heldout) never appear.

    python scripts/train_tiny_model.py --out kvdiag/assets/tiny-llama            # CUDA if present
    python scripts/train_tiny_model.py --out /tmp/tiny --device cpu                # same recipe on CPU
    python scripts/train_tiny_model.py --arch qwen3 --out kvdiag/assets/zoo/qwen3  # a zoo model (kvdiag.models.zoo)

``--arch`` picks the model zoo's preset (``llama``, the shipped model, by default; ``qwen3``, ``gemma3``,
``deepseek-v2``, ``granite-hybrid``, ``gpt-oss``, ``llama-outlier``; docs/zoo.md): its config from kvdiag.models.zoo,
built with transformers' AutoModelForCausalLM, trained the same way. ``--layers``/``--hidden``/... override the preset's
sizes; ``--tiny`` takes the preset's CPU-test size (a smoke test). ``llama-outlier`` is trained as ``llama`` and
its K channels are made large at the end (kvdiag.models.zoo.add_k_outliers; the model's outputs do not change).

The defaults are the shipped recipe (its time on a GPU and on CPU cores: kvdiag/assets/tiny-llama/README.md,
which records the run). The result is saved in bfloat16
with the byte tokenizer (kvdiag.models.gen); training_log.json records the run. A run with a shipped model's recipe
(``--arch qwen3``, ``gemma3``, ``deepseek-v2``, ``granite-hybrid``) ends with a line comparing its recall with the
shipped run's, and exits 1 when it learned less than half of it: GPU training is not bit-reproducible.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdiag.models import gen as modelgen  # noqa: E402
from kvdiag.models import zoo  # noqa: E402
from kvdiag.tasks import recall  # noqa: E402

SPACE, EQ, SEMI = ord(" "), ord("="), ord(";")
RUN_ONLY = ("out", "device", "time_limit")  # arguments that do not change what a run trains
REBUILD_SLACK = 0.5  # a rebuild below this share of the shipped run's recall did not learn what it did
LETTER0, DIGIT0 = ord("a"), ord("0")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory to write the checkpoint to")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=1234, help="default: 1234, or the preset's recipe (deepseek-v2 1)")
    p.add_argument("--steps", type=int, default=1300, help="default: 1300, or the preset's recipe (gemma3 4000, "
                   "deepseek-v2 6000)")
    p.add_argument("--tokens-per-batch", type=int, default=16384)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--min-pairs", type=int, default=2)
    p.add_argument("--start-pairs", type=int, default=4, help="first n_max of the curriculum")
    p.add_argument("--max-pairs", type=int, default=100)
    p.add_argument("--promote-at", type=float, default=0.9, help="first-digit accuracy that lets n_max grow")
    p.add_argument("--key-loss", type=int, default=1, help="also train on the queried key's letters 2..4")
    p.add_argument("--decay", type=float, default=0.25, help="fraction of steps with decaying lr")
    p.add_argument("--key-len", type=int, default=recall.KEY_LEN)
    p.add_argument("--value-len", type=int, default=recall.VALUE_LEN)
    p.add_argument("--max-queries", type=int, default=32)
    p.add_argument("--arch", default="llama", choices=zoo.names(), help="the zoo preset to train (docs/zoo.md)")
    p.add_argument("--tiny", action="store_true", help="the preset's few-layer CPU-test size (smoke tests)")
    p.add_argument("--layers", type=int, default=None, help="default: the preset's (4)")
    p.add_argument("--hidden", type=int, default=None, help="default: the preset's (256)")
    p.add_argument("--heads", type=int, default=None, help="default: the preset's (4)")
    p.add_argument("--kv-heads", type=int, default=None, help="default: the preset's (2)")
    p.add_argument("--head-dim", type=int, default=None, help="default: the preset's (llama: hidden / heads)")
    p.add_argument("--intermediate", type=int, default=None, help="default: the preset's (384)")
    p.add_argument("--max-positions", type=int, default=None, help="default: the preset's (2048)")
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-rows", type=int, default=64, help="sequences of the 16-pair check (long: a quarter)")
    p.add_argument("--time-limit", type=float, default=0, help="stop training after this many seconds (0: none)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.set_defaults(**zoo.preset(p.parse_known_args(argv)[0].arch).recipe)  # the preset's recipe (zoo.PRESETS)
    return p.parse_args(argv)


def shipped_record(arch: str) -> dict | None:
    """The summary of the run that made the shipped model of ``arch`` (its training_log.json), if one is shipped."""
    path = zoo.shipped_dir(arch) / "training_log.json"
    return json.loads(path.read_text())["summary"] if path.is_file() else None


def rebuild_check(args: dict, final: dict, recorded: dict | None) -> tuple[str, bool] | None:
    """(a line, whether the rebuild learned) comparing this run's recall with the shipped run's, when this run has the
    shipped run's arguments (``RUN_ONLY`` aside); None otherwise. Training on a GPU is not bit-reproducible: a
    rebuild can learn less than the run that made the shipped model."""
    def recipe(a):
        return {k: v for k, v in a.items() if k not in RUN_ONLY}

    if not recorded or recipe(recorded["args"]) != recipe(args):
        return None
    keys = ("acc16_bf16", "acc_long_early_bf16")
    ok = all(final[k] >= REBUILD_SLACK * recorded[k] for k in keys)
    line = (f"rebuild of {args['arch']}: exact recall {final[keys[0]]:.2f} on 16 pairs, {final[keys[1]]:.2f} on 64-96 "
            f"pairs; the shipped run: {recorded[keys[0]]:.2f}, {recorded[keys[1]]:.2f}")
    return (line if ok else line + " -- it learned less: train again with another --seed, or use the shipped "
            "model"), ok


# ---------------------------------------------------------------- data
def _distinct_rows(rng: np.random.Generator, pool: np.ndarray, rows: int, n: int) -> np.ndarray:
    """rows x n draws from pool, distinct within each row."""
    out = pool[rng.integers(0, len(pool), size=(rows, n))]
    while True:
        s = np.sort(out, axis=1)
        bad = np.nonzero((s[:, 1:] == s[:, :-1]).any(axis=1))[0]
        if len(bad) == 0:
            return out
        out[bad] = pool[rng.integers(0, len(pool), size=(len(bad), n))]


def _key_bytes(ids: np.ndarray) -> np.ndarray:
    digits = [(ids // len(recall.LETTERS) ** i) % len(recall.LETTERS) for i in range(recall.KEY_LEN)]
    return np.stack(digits, axis=-1) + LETTER0


def _value_bytes(vals: np.ndarray) -> np.ndarray:
    digits = [(vals // 10 ** (recall.VALUE_LEN - 1 - i)) % 10 for i in range(recall.VALUE_LEN)]
    return np.stack(digits, axis=-1) + DIGIT0


def make_batch(rng, key_pool, rows: int, n: int, q: int, early_frac: float = 1 / 3):
    """Token ids [rows, T] and token roles [rows, T]: 1 first value digit of a query, 2 its other
    digits, 3 the query key's 2nd..last letter and its '=' (predictable by copying too), 0 the rest."""
    keys = _distinct_rows(rng, key_pool, rows, n)
    vals = _distinct_rows(rng, np.arange(recall.N_VALUES), rows, n)
    kb, vb = _key_bytes(keys), _value_bytes(vals)  # [rows, n, 4]
    pair = np.concatenate([kb, np.full((rows, n, 1), EQ), vb, np.full((rows, n, 1), SPACE)], axis=2)
    ctx = pair.reshape(rows, n * recall.PAIR_TOKENS)  # "k=v k=v ... k=v "
    # queries: Gumbel top-q, pairs in the first 15% weighted so ~early_frac of queries land there
    n_early = max(1, int(math.ceil(0.15 * n)))
    w = np.ones(n)
    w[:n_early] = max(1.0, early_frac / (1 - early_frac) * (n - n_early) / n_early)
    scores = np.log(w) + rng.gumbel(size=(rows, n))
    qi = np.argsort(-scores, axis=1)[:, :q]  # [rows, q]
    qk = np.take_along_axis(kb, qi[:, :, None], axis=1)
    qv = np.take_along_axis(vb, qi[:, :, None], axis=1)
    query = np.concatenate([np.full((rows, q, 1), SPACE), qk, np.full((rows, q, 1), EQ), qv], axis=2)
    query = query.reshape(rows, q * recall.PAIR_TOKENS)
    bos = np.full((rows, 1), modelgen.BOS_ID)
    ids = np.concatenate([bos, ctx, np.full((rows, 1), SEMI), query], axis=1)
    role = np.zeros_like(ids, dtype=np.int8)
    off = 1 + ctx.shape[1] + 1
    for j in range(q):
        k0 = off + j * recall.PAIR_TOKENS + 1
        s = k0 + recall.KEY_LEN + 1
        role[:, k0 + 1 : s] = 3
        role[:, s] = 1
        role[:, s + 1 : s + recall.VALUE_LEN] = 2
    return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(role), keys, vals, qi


def check_format(rng, key_pool):
    """The numpy batch must spell exactly what recall.prompt() writes."""
    ids, mask, keys, vals, qi = make_batch(rng, key_pool, 2, 5, 3)
    pairs = [(recall.key_text(int(k)), recall.value_text(int(v))) for k, v in zip(keys[0], vals[0])]
    k, v = pairs[int(qi[0, 0])]
    text = bytes(ids[0, 1:].tolist()).decode()
    assert text.startswith(recall.prompt(pairs, k) + v), (text, recall.prompt(pairs, k) + v)
    assert bytes(ids[0][(mask[0] == 1) | (mask[0] == 2)].tolist()).decode().startswith(v)
    assert bytes(ids[0][mask[0] == 3].tolist()).decode().startswith(k[1:] + "=")


# ---------------------------------------------------------------- model
def build_model(args):
    """The --arch preset's model (kvdiag.models.zoo) with the size options applied, transformers' random init; a preset
    that starts from tiny-llama (kvdiag.models.zoo_warm) does so at its own size."""
    sizes = dict(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                 num_key_value_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=args.intermediate,
                 max_position_embeddings=args.max_positions)
    if zoo.preset(args.arch).model_type == "llama" and args.head_dim is None and (args.hidden or args.heads):
        cfg = zoo.hf_config(args.arch, tiny=args.tiny, **sizes)
        sizes["head_dim"] = cfg.hidden_size // cfg.num_attention_heads
    if zoo.preset(args.arch).warm_from_llama and not args.tiny and not any(v is not None for v in sizes.values()):
        from kvdiag.models import zoo_warm

        return zoo_warm.from_llama(args.arch, seed=args.seed)
    return zoo.random_model(args.arch, seed=args.seed, tiny=args.tiny, **sizes)


@torch.no_grad()
def evaluate(model, device, rng, key_pool, rows, n_lo, n_hi, early: float | None, amp):
    """Exact match of all 4 digits of the first query (teacher-forced argmax)."""
    model.eval()
    correct = total = 0
    for n in range(n_lo, n_hi + 1, max(1, (n_hi - n_lo) // 4) if n_hi > n_lo else 1):
        ids, mask, keys, vals, qi = make_batch(rng, key_pool, rows, n, 1, early_frac=0.0)
        if early is not None:  # re-draw the query among the first `early` fraction of pairs
            ids, mask = _requery(ids, mask, rng, n, early)
        ids, mask = ids.to(device), mask.to(device)
        with amp():
            logits = model(ids[:, :-1]).logits
        pred = logits.argmax(-1)
        tgt, m = ids[:, 1:], (mask[:, 1:] == 1) | (mask[:, 1:] == 2)
        ok = ((pred == tgt) | ~m).all(dim=1)
        correct += int(ok.sum())
        total += ids.shape[0]
    model.train()
    return correct / total


def state_layers_zeroed(model, eval_keys, rows, amp) -> dict:
    """The long check again with every Mamba layer's output projection zeroed (the layers as inserted), and the
    mean KL of the answer digits' distributions between the two: 0 would mean the state layers do nothing."""
    import copy

    ablated = copy.deepcopy(model)
    for name, prm in ablated.named_parameters():
        if name.endswith("mamba.out_proj.weight"):
            prm.data.zero_()
    ids, mask, *_ = make_batch(np.random.default_rng(9), eval_keys, rows, 80, 8)
    m = (mask[:, 1:] == 1) | (mask[:, 1:] == 2)
    with torch.no_grad(), amp():
        lp = [torch.log_softmax(x(ids[:, :-1]).logits[m].float(), -1) for x in (model, ablated)]
    kl = (lp[0].exp() * (lp[0] - lp[1])).sum(-1).mean().item()
    acc = evaluate(ablated, torch.device("cpu"), np.random.default_rng(8), eval_keys, rows, 64, 96, 0.1, amp)
    return {"acc_long_early_bf16_state_layers_zeroed": acc, "answer_kl_state_layers_zeroed": round(kl, 4)}


def _requery(ids, mask, rng, n, early):
    ids = ids.clone()
    n_first = max(1, int(math.ceil(early * n)))
    ctx0 = 1
    qpos = 1 + n * recall.PAIR_TOKENS + 1 + 1  # first query key
    for r in range(ids.shape[0]):
        i = int(rng.integers(0, n_first))
        src = ctx0 + i * recall.PAIR_TOKENS
        ids[r, qpos : qpos + recall.PAIR_TOKENS - 1] = ids[r, src : src + recall.PAIR_TOKENS - 1]
    return ids, mask


def lr_at(step, args):
    """Warm up, hold, then decay linearly to 10% over the last --decay fraction of steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    decay_start = int(args.steps * (1 - args.decay))
    if step < decay_start:
        return args.lr
    return args.lr * (1 - 0.9 * (step - decay_start) / max(1, args.steps - decay_start))


class Curriculum:
    """n ~ U[min_pairs, n_max]; n_max grows x1.3 each time recall at the hard end is mastered."""

    def __init__(self, args):
        self.args, self.n_max, self.ema, self.history = args, args.start_pairs, 0.0, []

    def sample(self, rng) -> int:
        return int(rng.integers(self.args.min_pairs, self.n_max + 1))

    def update(self, step, n, digit_acc, tokens):
        if n * 2 < self.n_max:
            return
        self.ema = 0.95 * self.ema + 0.05 * digit_acc
        if self.ema > self.args.promote_at and self.n_max < self.args.max_pairs:
            self.n_max = min(self.args.max_pairs, math.ceil(self.n_max * 1.3))
            self.ema = 0.5
            self.history.append({"step": step, "tokens": tokens, "n_max": self.n_max})
            print(json.dumps({"curriculum": self.history[-1]}), flush=True)


def main(argv=None) -> int:
    """Train, save, and return 0; 1 when the run has the shipped model's recipe and learned less (rebuild_check)."""
    args = parse_args(argv)
    recorded = shipped_record(args.arch)  # read first: --out may be the shipped folder itself
    if (args.key_len, args.value_len) != (recall.KEY_LEN, recall.VALUE_LEN):  # experiments only
        recall.KEY_LEN, recall.VALUE_LEN = args.key_len, args.value_len
        recall.N_KEYS, recall.N_VALUES = len(recall.LETTERS) ** args.key_len, 10**args.value_len
        recall.PAIR_TOKENS = args.key_len + args.value_len + 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True

    def amp():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    all_keys = np.arange(recall.N_KEYS, dtype=np.int64)
    heldout = recall.is_heldout(all_keys)
    train_keys, eval_keys = all_keys[~heldout], all_keys[heldout]
    rng = np.random.default_rng(args.seed)
    eval_rng = np.random.default_rng(args.seed + 1_000_003)
    check_format(np.random.default_rng(0), train_keys)

    model = build_model(args).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
        fused=cuda,
    )
    print(json.dumps({"params": n_params, "args": vars(args)}), flush=True)
    log = []
    rows16, rows_long = args.eval_rows, max(1, args.eval_rows // 4)
    cur = Curriculum(args)
    t0 = time.time()
    tokens = 0
    for step in range(args.steps):
        n = cur.sample(rng)
        q = min(n, args.max_queries)
        T = 2 + n * recall.PAIR_TOKENS + q * recall.PAIR_TOKENS
        rows = max(4, args.tokens_per_batch // T)
        ids, mask, *_ = make_batch(rng, train_keys, rows, n, q)
        if rng.random() < 0.1:  # now and then no <s>, so a missing BOS does not derail recall
            ids, mask = ids[:, 1:], mask[:, 1:]
        ids, mask = ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args)
        with amp():
            logits = model(ids[:, :-1]).logits
        role = mask[:, 1:]
        m = (role > 0) if args.key_loss else (role == 1) | (role == 2)
        tgt = ids[:, 1:][m]
        sel = logits[m].float()
        loss = torch.nn.functional.cross_entropy(sel, tgt)
        first = role[m] == 1
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += ids.numel()
        cur.update(step, n, (sel.argmax(-1) == tgt)[first].float().mean().item(), tokens)
        stop = args.time_limit and time.time() - t0 > args.time_limit
        if stop:
            print(json.dumps({"stopped_at_step": step, "time_limit": args.time_limit}), flush=True)
        if step % 25 == 0 or step == args.steps - 1 or stop:
            rec = {"step": step, "n": n, "n_max": cur.n_max, "ema": round(cur.ema, 3), "rows": rows,
                   "loss": round(loss.item(), 4), "s": round(time.time() - t0, 1)}
            if (step % args.eval_every == 0 and step) or step == args.steps - 1 or stop:
                rec["acc16"] = evaluate(model, device, eval_rng, eval_keys, rows16, 16, 16, None, amp)
                rec["acc_long_early"] = evaluate(model, device, eval_rng, eval_keys, rows_long, 64, 96, 0.1, amp)
            log.append(rec)
            print(json.dumps(rec), flush=True)
        if stop:
            break
    steps_done = step + 1
    train_s = time.time() - t0

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16).cpu()
    cpu, no_amp = torch.device("cpu"), lambda: torch.autocast("cpu", enabled=False)
    final = {
        "acc16_bf16": evaluate(model, cpu, np.random.default_rng(7), eval_keys, max(1, rows16 // 2), 16, 16, None,
                               no_amp),
        "acc_long_early_bf16": evaluate(model, cpu, np.random.default_rng(8), eval_keys, max(1, rows_long // 2), 64,
                                        96, 0.1, no_amp),
    }
    if zoo.preset(args.arch).warm_from_llama:  # how much the inserted state layers now matter
        final.update(state_layers_zeroed(model, eval_keys, max(1, rows_long // 2), no_amp))
    zoo.save_checkpoint(model, out)
    if zoo.preset(args.arch).outliers:
        zoo.add_k_outliers(out)
    zoo.write_marker(out, args.arch, trained=True, seed=args.seed, steps=steps_done, **final)
    summary = {
        "params": n_params,
        "train_seconds": round(train_s, 1),
        "steps_done": steps_done,
        "seconds_per_step": round(train_s / steps_done, 3),
        "tokens": tokens,
        "device": str(device) + (f" ({torch.cuda.get_device_name()})" if cuda else ""),
        "torch": torch.__version__,
        "command": "python scripts/train_tiny_model.py " + " ".join(sys.argv[1:] if argv is None else argv),
        **final,
        "curriculum": cur.history,
        "args": vars(args),
    }
    (out / "training_log.json").write_text(json.dumps({"summary": summary, "log": log}, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    check = rebuild_check(vars(args), final, recorded)
    if check:
        print(check[0], file=sys.stderr, flush=True)
    return 0 if check is None or check[1] else 1


if __name__ == "__main__":
    sys.exit(main())
