"""Next-token training of a small target on token batches, to make tiny target/drafter pairs whose
target actually models the data (a random target would leave nothing for a drafter to learn).
Used by the tests and the benchmarks; real targets come from Hugging Face checkpoints."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dspark_jax.config import TargetConfig
from dspark_jax.models.target import forward


def fit_target(params, cfg: TargetConfig, batches: Iterator[dict], steps: int,
               learning_rate: float = 3e-3, *, warmup_steps: int = 0, cosine: bool = False,
               weight_decay: float = 0.0, clip_norm: float | None = None,
               on_step: Callable[[int, float], None] | None = None
               ) -> tuple[dict, list[float]]:
    """AdamW on next-token cross-entropy over every non-padding token; returns (params, losses).

    `batches` yields {"input_ids": [B, L], "loss_mask": [B, L]} (the data pipeline's batches); the
    loss covers positions whose next token is inside the sequence's supervised span or prompt, i.e.
    all tokens up to the last supervised one. The learning rate warms up linearly over
    `warmup_steps` and, with `cosine`, decays to a tenth by the last step (constant otherwise);
    `clip_norm` clips the gradient's global norm.
    `on_step(step, loss)` is called every step (reading the loss waits for that step).
    """
    if cosine:
        schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(warmup_steps, 1),
                                                      max(steps, warmup_steps + 1),
                                                      end_value=learning_rate / 10)
    else:
        schedule = optax.join_schedules([optax.linear_schedule(0.0, learning_rate, warmup_steps),
                                         optax.constant_schedule(learning_rate)], [warmup_steps]) \
            if warmup_steps else learning_rate
    opt = optax.adamw(schedule, weight_decay=weight_decay) if weight_decay else optax.adam(schedule)
    if clip_norm is not None:
        opt = optax.chain(optax.clip_by_global_norm(clip_norm), opt)

    def loss_fn(p, ids, weight):
        B, L = ids.shape
        out = forward(p, cfg, ids, jnp.broadcast_to(jnp.arange(L), (B, L)))
        logp = jax.nn.log_softmax(out.logits[:, :-1], -1)
        nll = -jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
        return jnp.sum(nll * weight) / jnp.maximum(jnp.sum(weight), 1.0)

    @jax.jit
    def step(p, opt_state, ids, weight):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids, weight)
        updates, opt_state = opt.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    opt_state = opt.init(params)
    losses = []
    for i in range(steps):
        batch = next(batches)
        mask = jnp.asarray(batch["loss_mask"])
        # Everything before the last supervised token is real text (prompt or answer).
        last = jnp.max(jnp.where(mask, jnp.arange(mask.shape[1]), -1), axis=1)
        weight = (jnp.arange(1, mask.shape[1])[None] <= last[:, None]).astype(jnp.float32)
        params, opt_state, loss = step(params, opt_state, jnp.asarray(batch["input_ids"]), weight)
        losses.append(loss)
        if on_step is not None:
            on_step(i + 1, float(loss))
    return params, [float(x) for x in jax.device_get(losses)]


def packed_batches(sequences, *, row_length: int, batch_size: int, separator: int, seed: int
                   ) -> Iterator[dict]:
    """Endless next-token batches of `sequences` (token id arrays) packed end to end, each followed
    by `separator`, cut into rows of `row_length` (no padding: a short conversation shares its row
    with the next ones, as LM pretraining packs documents). The row order is reshuffled every
    epoch (`default_rng([seed, epoch])`); the last partial row of the stream is dropped."""
    stream = np.concatenate([np.append(np.asarray(s, np.int32), separator) for s in sequences])
    rows = stream[:len(stream) // row_length * row_length].reshape(-1, row_length)
    if len(rows) < batch_size:
        raise ValueError(f"{len(stream)} tokens make {len(rows)} rows of {row_length}; need at "
                         f"least a batch of {batch_size}")
    ones = np.ones((batch_size, row_length), bool)
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(len(rows))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            yield {"input_ids": rows[order[i:i + batch_size]], "loss_mask": ones}
        epoch += 1


def prepare_target_dir(out_dir, data_file, cfg: TargetConfig, *, seed: int, max_length: int,
                       batch_size: int = 16, init_std: float = 0.1, packed: bool = False):
    """Trains a BPE tokenizer on the data's text into out_dir (vocabulary cfg.vocab_size, ChatML
    specials at ids 0..3, Qwen3's generation_config stop ids), initialises the target's weights
    (normal, `init_std`) and loads the data's conversations as next-token batches: one per row
    cut to `max_length` (a BatchIterator), or with `packed` end to end in rows of `max_length`
    (`packed_batches`). Returns (params, batches, tokenizer, the Dataset)."""
    import json
    from pathlib import Path

    from dspark_jax.formats.tokenizer import load_tokenizer, train_bpe_tokenizer
    from dspark_jax.models.target import target_spec
    from dspark_jax.params import init_params
    from dspark_jax.training.data import BatchIterator, load_conversations

    out = Path(out_dir)
    texts = [m.get("content", "") for line in Path(data_file).read_text().splitlines() if line.strip()
             for m in json.loads(line).get("conversations", [])]
    train_bpe_tokenizer(texts, cfg.vocab_size, out)
    tokenizer = load_tokenizer(out)
    # Stop ids as Qwen3's generation_config lists them: <|im_end|> ends a chat turn, <|endoftext|>
    # a document.
    im_end, end_of_text = tokenizer.token_id("<|im_end|>"), tokenizer.token_id("<|endoftext|>")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [im_end, end_of_text]}) + "\n")
    params = init_params(target_spec(cfg), jax.random.key(seed))  # std 0.02 for matrices
    params = jax.tree.map(lambda x: x * (init_std / 0.02) if x.ndim > 1 else x, params)
    ds = load_conversations(data_file, tokenizer, max_length=cfg.max_position_embeddings if packed
                            else max_length, min_length=2, system_prompt="")  # as the tiny presets
    if packed:
        batches = packed_batches(ds.input_ids, row_length=max_length, batch_size=batch_size,
                                 separator=tokenizer.token_id("<|endoftext|>"), seed=seed)
    else:
        batches = iter(BatchIterator(ds, global_batch_size=min(batch_size, len(ds)), num_anchors=1,
                                     block_size=1, seed=seed))
    return params, batches, tokenizer, ds


def save_target_dir(params, cfg: TargetConfig, out_dir, tokenizer) -> None:
    """Writes the weights (in cfg.dtype) and config.json beside the tokenizer
    `prepare_target_dir` wrote; config.json's eos_token_id is <|im_end|>."""
    import json
    from pathlib import Path

    from dspark_jax.formats import hf_checkpoint

    out = Path(out_dir)
    hf_checkpoint.save_target(params, cfg, out)
    config = json.loads((out / "config.json").read_text())
    config["eos_token_id"] = tokenizer.token_id("<|im_end|>")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_tiny_target(out_dir, data_file, cfg: TargetConfig, *, steps: int = 150, seed: int = 0,
                     max_length: int = 64):
    """A tiny Hugging Face Qwen3 directory that models `data_file`: a BPE tokenizer trained on the
    data's text, random weights (std 0.1: a livelier start) fitted for `steps` next-token steps.
    Returns (params, out_dir)."""
    from pathlib import Path

    params, batches, tokenizer, _ = prepare_target_dir(out_dir, data_file, cfg, seed=seed,
                                                       max_length=max_length)
    params, _ = fit_target(params, cfg, batches, steps)
    save_target_dir(params, cfg, out_dir, tokenizer)
    return params, Path(out_dir)
