"""Tokenizers: the locally built character tokenizer of the CPU demo, and one loader for all kinds.

The demo must run without downloads, so its tokenizer is built here with the `tokenizers` library:
one token per character, plus `<pad>`, `<bos>`, `<eos>`, `<unk>`; 96 tokens in all, matching
`configs/models/tiny-demo/config.json` (vocab_size 96).

Loading. transformers 5.x `AutoTokenizer` on a folder whose `config.json` names a model type (e.g.
Qwen2) builds that model's tokenizer class and ignores a locally built `tokenizer.json` (it then
encodes text to `[]`, see docs/platform.md). `load_tokenizer` therefore loads a locally built
tokenizer through `PreTrainedTokenizerFast` directly, and only hands real HF tokenizer folders to
`AutoTokenizer`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS: dict[str, str] = {
    "pad_token": "<pad>",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "unk_token": "<unk>",
}
# Printable ASCII is 95 characters; with newline and the 4 special tokens that is 100. These four are
# dropped to fit the tiny model's 96-token vocabulary: no demo prompt, template or answer uses them.
DROPPED_CHARACTERS = "`^|~"
CHARACTERS: tuple[str, ...] = ("\n",) + tuple(
    chr(code) for code in range(32, 127) if chr(code) not in DROPPED_CHARACTERS
)
CHAR_VOCAB_SIZE = len(SPECIAL_TOKENS) + len(CHARACTERS)

# A minimal chat template so `data.apply_chat_template` works with the demo tokenizer too.
CHAR_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# The tool-use demo's template (`tools/make_demo_model.py --chat-template tool`, `make demo-tools`): the
# same, except that a tool message is its bare content and the model's next turn follows it directly,
# with no "assistant: " header in between. Why: the tiny random model learns to continue the character
# right before it within a short run, not to copy one from further back (hybridrl/data/demo_task.py),
# so the tool's answer must end where the model's answer starts (hybridrl/data/secret_task.py).
CHAR_TOOL_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'tool' %}{{ message['content'] }}"
    "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt and messages[-1]['role'] != 'tool' %}assistant: {% endif %}"
)
CHAT_TEMPLATES = {"chat": CHAR_CHAT_TEMPLATE, "tool": CHAR_TOOL_CHAT_TEMPLATE}

# Marker in tokenizer_config.json: this folder holds a tokenizer built by `build_char_tokenizer`.
_LOCAL_MARKER = "hybridrl_char_tokenizer"


def build_char_tokenizer() -> Any:
    """The demo's character-level `tokenizers.Tokenizer` (special tokens first: pad=0, bos=1, eos=2, unk=3)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS.values(), *CHARACTERS])}
    assert len(vocab) == CHAR_VOCAB_SIZE, "duplicate characters in the vocabulary"
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    # Every character (newline included) is its own pre-token; WordLevel then maps it to one id.
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse joins the characters back without the spaces a default decode would insert.
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS.values()))
    return tokenizer


def char_tokenizer(chat_template: str | None = CHAR_CHAT_TEMPLATE) -> Any:
    """The character tokenizer wrapped as a transformers `PreTrainedTokenizerFast`."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_char_tokenizer(), **SPECIAL_TOKENS)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def save_char_tokenizer(folder: str | Path, chat_template: str | None = CHAR_CHAT_TEMPLATE) -> Path:
    """Write `tokenizer.json` (+ `tokenizer_config.json` with the special-token roles) into `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_char_tokenizer().save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {**SPECIAL_TOKENS, _LOCAL_MARKER: True, "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder / "tokenizer.json"


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """Load a tokenizer from a `tokenizer.json` file, a locally built folder, or an HF tokenizer folder.

    - a `.json` file, or a folder with `tokenizer.json` and either no `tokenizer_config.json` or one
      written by `save_char_tokenizer`: `PreTrainedTokenizerFast(tokenizer_file=...)`, with the
      `<pad>/<bos>/<eos>/<unk>` roles assigned when those tokens exist;
    - any other folder: `AutoTokenizer.from_pretrained(path, local_files_only=True)` (never downloads).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    tokenizer_file: Path | None = None
    config: dict[str, Any] = {}
    if path.is_file():
        tokenizer_file = path
        sibling_config = path.parent / "tokenizer_config.json"
        if sibling_config.is_file():
            config = json.loads(sibling_config.read_text())
    elif (path / "tokenizer.json").is_file():
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        if not config_file.is_file() or config.get(_LOCAL_MARKER):
            tokenizer_file = path / "tokenizer.json"
    if tokenizer_file is None:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)

    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_file)).get_vocab()
    roles = {role: config.get(role, token) for role, token in SPECIAL_TOKENS.items()}
    roles = {role: token for role, token in roles.items() if isinstance(token, str) and token in vocab}
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), **roles)
    if config.get("chat_template"):
        tokenizer.chat_template = config["chat_template"]
    return tokenizer


def tokenizer_size(path: str | Path, trust_remote_code: bool = False) -> int:
    """How many token ids the tokenizer at `path` can produce: one more than its highest id (vocabulary, added
    tokens, and tokenizer_config.json's added_tokens_decoder). What the plan checks against a model's vocab_size.

    Read from the files `load_tokenizer` reads, without transformers where a tokenizer.json is there (both of its
    routes parse that file with the `tokenizers` library, which this calls): torch-free and fast. A folder holding
    only a slow tokenizer (tokenizer.model, vocab.json) is loaded by `load_tokenizer` itself. Raises `ValueError`
    naming the file that does not load (or what `load_tokenizer` raises).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenizer path {str(path)!r} does not exist")
    folder = path if path.is_dir() else path.parent
    ids: list[int] = []
    config_file = folder / "tokenizer_config.json"
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as error:
            raise ValueError(f"{config_file} is not JSON ({error})") from error
        decoder = config.get("added_tokens_decoder") if isinstance(config, dict) else None
        ids += [int(key) for key in (decoder or {}) if str(key).isdigit()]
    fast = path if path.is_file() else path / "tokenizer.json"
    if fast.is_file():
        from tokenizers import Tokenizer

        try:
            vocab = Tokenizer.from_file(str(fast)).get_vocab(with_added_tokens=True)
        except Exception as error:  # the tokenizers library raises Exception itself (a serde message)
            raise ValueError(f"{fast} is not a tokenizer the tokenizers library reads ({error})") from error
        return max([*ids, *vocab.values()], default=-1) + 1
    return max([len(load_tokenizer(path, trust_remote_code=trust_remote_code)), *(i + 1 for i in ids)])


def _json_field(path: Path, key: str) -> Any:
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get(key)


def resolve_pad_token_id(tokenizer: Any, model_path: str | Path) -> int:
    """The one pad id of a run: prompts are left-padded, responses right-padded and the sync probe's
    rows filled with it (trainer, rollout engine and workers all take it from here, resolved once).

    Order: the tokenizer's pad token (what the tokenizer files say, and what the data pads with), else
    the model folder's ``config.json`` / ``generation_config.json`` ``pad_token_id``, else the first EOS
    id, else 0. The value never decides what is trained or scored: every padded position is cut by the
    attention and response masks, so a pad equal to EOS (SmolLM2: both ``<|im_end|>``) leaves the
    response's final EOS in the response mask.
    """
    pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
    folder = Path(model_path)
    for file_name in ("config.json", "generation_config.json"):
        if pad is None:
            pad = _json_field(folder / file_name, "pad_token_id")
    if pad is None:
        eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        for file_name in ("generation_config.json", "config.json"):
            if eos is None:
                eos = _json_field(folder / file_name, "eos_token_id")
        pad = eos[0] if isinstance(eos, list) and eos else eos
    if isinstance(pad, list):  # a config may list several; padding needs one
        pad = pad[0] if pad else None
    return int(pad) if pad is not None else 0


def model_folder_pad_token_id(model_path: str | Path, tokenizer_path: str | Path | None = None,
                              trust_remote_code: bool = False) -> int:
    """`resolve_pad_token_id` for a model section (path, tokenizer path) when no tokenizer is loaded
    yet: weight-only folders (tests, benchmarks) have no tokenizer files, so their config files decide."""
    source = Path(tokenizer_path or model_path)
    has_tokenizer = source.is_file() or any(
        (source / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    tokenizer = load_tokenizer(source, trust_remote_code=trust_remote_code) if has_tokenizer else None
    return resolve_pad_token_id(tokenizer, model_path)
