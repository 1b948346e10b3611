"""TRL's GRPOTrainer on CPU for `bench/vs_trl.py`: run by the TRL venv's python (bench/.venv-trl), not hybridrl's.

Same inputs as the hybridrl side: the HF model folder and its local char tokenizer, the synthetic
"repeat the letter" prompts, hybridrl's own `repeat_letter` scorer (pure Python, imported from the
repo), n samples per prompt, full-length responses (EOS suppressed with min_new_tokens), one optimizer
step per generation batch, constant learning rate, no KL (beta=0), HF generate (no vLLM), fp32, one
torch thread. Writes per-step wall/CPU times (and generation+scoring time) as JSON.

`--task arith_word` (bench/vs_trl.py --model real): the real model's folder with its own tokenizer and
chat template (TRL applies it to the conversational prompts), the `arith_word` scorer, responses that
stop at the model's EOS, sampled at `--temperature`.

    bench/.venv-trl/bin/python bench/trl_grpo_run.py --model DIR --data FILE --prompts P --n N \
        --max-completion L --micro M --lr LR --steps S --out FILE.json
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    if len(sys.argv) == 1:  # `make bench` runs every bench/*.py: this one only serves bench/vs_trl.py
        print("bench/trl_grpo_run.py: the TRL side of bench/vs_trl.py (run by it in the TRL venv); nothing to do")
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--prompts", type=int, required=True)
    parser.add_argument("--n", type=int, required=True)
    parser.add_argument("--max-completion", type=int, required=True)
    parser.add_argument("--micro", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    parser.add_argument("--bf16", action="store_true", help="autocast bf16 (weights and optimizer stay fp32)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (cores given to TRL)")
    parser.add_argument("--task", choices=("repeat_letter", "arith_word"), default="repeat_letter",
                        help="arith_word: the real model's task (chat-template prompts, the model folder's own "
                             "tokenizer, stop at EOS, sampled at --temperature)")
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    import datasets
    import transformers
    import trl

    sys.path.insert(0, str(ROOT))
    from hybridrl.rewards import get_scorer  # pure Python: the scorer hybridrl uses

    if args.task == "arith_word":
        import hybridrl.data.arith_task  # noqa: F401  (registers the arith_word scorer)
    scorer = get_scorer(args.task)

    def reward(completions: list, ground_truth: list[str], **_: object) -> list[float]:
        # conversational prompts give completions as [{"role": "assistant", "content": ...}]
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [scorer(text, truth).score for text, truth in zip(texts, ground_truth)]

    reward.__name__ = args.task
    rows = [json.loads(line) for line in Path(args.data).read_text().splitlines() if line.strip()]
    rows = rows[: args.prompts * args.steps * 2]
    dataset = datasets.Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows])
    if args.task == "arith_word":  # a real model: its own tokenizer and chat template (TRL applies it)
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    else:
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(Path(args.model) / "tokenizer.json"), pad_token="<pad>", bos_token="<bos>",
            eos_token="<eos>", unk_token="<unk>")
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    sequences = args.prompts * args.n
    if sequences % args.micro:
        raise SystemExit(f"prompts*n={sequences} is not a multiple of micro={args.micro}")
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_grpo_"), use_cpu=True, bf16=args.bf16, fp16=False,
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=sequences // args.micro,
        num_generations=args.n, max_completion_length=args.max_completion, temperature=args.temperature,
        top_p=1.0, top_k=0,
        # the synthetic task: full-length responses, as hybridrl's ignore_eos; the real one stops at EOS
        generation_kwargs={"min_new_tokens": args.max_completion} if args.task == "repeat_letter" else None,
        beta=0.0, num_iterations=1, epsilon=0.2,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_steps=args.steps, logging_steps=1,
        save_strategy="no", report_to=[], seed=args.seed, dataloader_num_workers=0, disable_tqdm=True,
        gradient_checkpointing=False,  # TRL defaults to recomputation; hybridrl runs without it
    )

    marks: dict[str, list[float]] = {"end_wall": [], "end_cpu": [], "gen_wall": [], "gen_cpu": []}

    class StepClock(transformers.TrainerCallback):
        def on_train_begin(self, *_a, **_k):
            marks["begin"] = [time.perf_counter(), time.process_time()]

        def on_step_end(self, *_a, **_k):
            marks["end_wall"].append(time.perf_counter())
            marks["end_cpu"].append(time.process_time())

    class TimedGRPOTrainer(trl.GRPOTrainer):
        def _generate_and_score_completions(self, *a, **k):  # generation + rewards (+ old log-probs if needed)
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                marks["gen_wall"].append(time.perf_counter() - wall)
                marks["gen_cpu"].append(time.process_time() - cpu)

    trainer = TimedGRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    wall0, cpu0 = marks["begin"]
    walls = [e - s for s, e in zip([wall0, *marks["end_wall"]], marks["end_wall"])]
    cpus = [e - s for s, e in zip([cpu0, *marks["end_cpu"]], marks["end_cpu"])]
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    lengths = [h.get("completions/mean_length") for h in trainer.state.log_history if "reward" in h]
    out = {"step_wall_s": walls, "step_cpu_s": cpus, "gen_score_wall_s": marks["gen_wall"],
           "gen_score_cpu_s": marks["gen_cpu"], "reward": rewards, "completion_mean_length": lengths,
           "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
           "torch_threads": torch.get_num_threads()}
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
