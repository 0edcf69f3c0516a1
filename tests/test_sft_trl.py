"""SFT under a chat template whose turns end with their own token (ChatML's ``<|im_end|>\\n``) against TRL's SFTTrainer
itself: the same records through TRL's data processing (``SFTTrainer._prepare_dataset``, its collator) and through
nxdt's (``build_sft_examples``) give the same tokens, the same trained positions and the same loss on the same weights.

TRL's two conversational modes are covered: prompt-completion records with the completion-only loss (TRL's default for
that format) and multi-turn ``messages`` records with ``assistant_only_loss`` (a template marking each reply with
``{% generation %}``), where every assistant turn is trained. TRL appends no EOS to conversational data; nxdt did (one
extra trained token per record, 0.8 % of the step-1 loss on NxDT's SFT config), which these tests would catch.
"""

from __future__ import annotations

import importlib.util

import json
from types import SimpleNamespace

import pytest
import torch

from models.llama import LlamaForCausalLM
from nxdt.data import SAMPLE_INSTRUCTIONS
from nxdt.data.instructions import IGNORE_INDEX, build_sft_examples, load_chat_tokenizer, read_instruction_records
from nxdt.lightning.hf import hf_name
from nxdt.lightning.objective import CAUSAL_LM

from hf_reference import llama_config
from test_sft_e2e import TEMPLATE, _tokenizer

trl = pytest.importorskip("trl", minversion="0.20")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("datasets") is None:  # imported by the test that uses it: ~0.8 CPU-s at collection
    pytest.skip("datasets is not installed (TRL's dependency, in the [test] extra)", allow_module_level=True)

SEQ = 256
SHAPE = dict(
    vocab_size=272,  # the test tokenizer's 260 tokens, rounded up
    hidden_size=32,
    ffn_hidden_size=64,
    num_layers=1,
    num_attention_heads=4,
    num_kv_heads=2,
    max_position_embeddings=SEQ,
    rope_theta=10000.0,
    norm_eps=1e-5,
)
# ChatML with each assistant reply (content and end of turn) inside {% generation %}: TRL's assistant_only_loss mask
MARKED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "And times 4?"},
        {"role": "assistant", "content": "20, as 5 * 4 = 20."},
    ],
    [{"role": "user", "content": "Reverse: abc"}, {"role": "assistant", "content": "cba"}],
]


def _models():
    """nxdt's Llama and transformers' with the same weights."""
    torch.manual_seed(0)
    ours = LlamaForCausalLM(
        SimpleNamespace(
            **SHAPE,
            tie_word_embeddings=False,
            init_method_std=0.02,
            activations_checkpoint_granularity=None,
            core_attention="sdpa",
        )
    ).eval()
    hf = transformers.LlamaForCausalLM(llama_config(transformers, SHAPE)).eval()
    hf.load_state_dict({hf_name(n): t for n, t in ours.state_dict().items()}, strict=True)
    return ours, hf


def _tokenizer_dir(tmp_path, template: str):
    directory = _tokenizer(tmp_path / "tokenizer")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return directory


def _trl_batch(directory, rows, tmp_path, **config):
    """TRL's SFTTrainer on ``rows``: its tokenized dataset, collated into one batch (its own collator), and the trainer."""
    _, hf = _models()
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=len(rows),
        max_length=None,
        packing=False,
        dataset_num_proc=None,
        **config,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    import datasets

    trainer = trl.SFTTrainer(model=hf, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer)
    examples = [trainer.train_dataset[i] for i in range(len(rows))]
    return trainer, examples, trainer.data_collator(examples)


def _compare(directory, records, trainer, examples, batch):
    """Token for token: nxdt's rows (shifted: input_ids = tokens[:-1], labels[t] = tokens[t+1] where trained) against
    TRL's (input_ids, labels with -100 outside the completion / assistant mask); then the loss of one batch."""
    tok = load_chat_tokenizer(directory)
    ours_batch, stats = build_sft_examples(records, tok, SEQ, packing=False)
    assert stats.truncated == 0 and stats.dropped == 0
    for row, example in enumerate(examples):
        ids, labels = example["input_ids"], example["labels"]
        n = len(ids) - 1
        assert ours_batch["input_ids"][row, :n].tolist() == ids[:-1], row
        assert ours_batch["labels"][row, :n].tolist() == labels[1:], row
        assert (ours_batch["labels"][row, n:] == IGNORE_INDEX).all(), row  # nothing trained after TRL's last token
    ours, _ = _models()  # the weights of TRL's model (same seed); TRL scores with the model it was given (it adapts it)
    with torch.no_grad():
        want = float(trainer.compute_loss(trainer.model, dict(batch)))
        logits = ours(ours_batch["input_ids"], ours_batch["position_ids"], ours_batch["segment_ids"])
        got = float(CAUSAL_LM.loss(ours, logits, ours_batch))
    # the token mean over the batch's trained tokens on both sides; two fp32 forwards of the same weights through two
    # implementations (sdpa with segment masks vs eager with a padding mask): ~1e-6 relative per log-probability, the
    # mean over ~100 tokens no worse; one token more or less (the EOS) moves it by ~1e-2
    assert got == pytest.approx(want, rel=1e-5)


def test_completion_only_loss_on_chatml_records_equals_trls_sft_trainer(tmp_path):
    """Instruction records (``instruction``/``input``/``output``) as nxdt renders them under a chat template — the user
    turn ``instruction + "\\n\\n" + input``, the assistant turn ``output`` — and as TRL's prompt-completion records:
    TRL trains the completion, ``output<|im_end|>\\n``, and nothing after it."""
    records = read_instruction_records(SAMPLE_INSTRUCTIONS, limit=6)
    rows = [
        {
            "prompt": [
                {"role": "user", "content": f"{r['instruction']}\n\n{r['input']}" if r.get("instruction") else r["input"]}
            ],
            "completion": [{"role": "assistant", "content": r["output"]}],
        }
        for r in records
    ]
    directory = _tokenizer_dir(tmp_path, TEMPLATE)
    trainer, examples, batch = _trl_batch(directory, rows, tmp_path)
    assert trainer.completion_only_loss
    tokenizer = trainer.processing_class
    first = [t for t, label in zip(examples[0]["input_ids"], examples[0]["labels"]) if label != IGNORE_INDEX]
    assert tokenizer.decode(first) == records[0]["output"] + "<|im_end|>\n"  # no EOS (<|end|>) after the turn
    _compare(directory, records, trainer, examples, batch)


def test_assistant_only_loss_on_multi_turn_chatml_equals_trls_sft_trainer(tmp_path):
    """Multi-turn ``messages`` records with TRL's ``assistant_only_loss``: every assistant reply, with its end of turn,
    trained; system and user turns and the role headers not."""
    directory = _tokenizer_dir(tmp_path, MARKED)
    trainer, examples, batch = _trl_batch(directory, [{"messages": m} for m in CHATS], tmp_path, assistant_only_loss=True)
    tokenizer = trainer.processing_class
    first = [t for t, label in zip(examples[0]["input_ids"], examples[0]["labels"]) if label != IGNORE_INDEX]
    assert tokenizer.decode(first) == "5<|im_end|>\n20, as 5 * 4 = 20.<|im_end|>\n"
    _compare(directory, [{"messages": m} for m in CHATS], trainer, examples, batch)
