"""The character-level tokenizer of dilaserve-tiny, written in the standard `tokenizers`
JSON format so the checkpoint's tokenizer loads through `transformers` exactly like a
released model's (`dilaserve.models.load_tokenizer`).

One token per character of the task alphabet plus the special tokens a diffusion LM needs.
Training encodes with the plain character table below (fast, no library call); a test
checks that the saved tokenizer agrees with it.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from dilaserve.models.tokenizer import write_tokenizer_config

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mdm_mask|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, MASK_TOKEN, UNK_TOKEN)
ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyz+-=,:>"

PAD_ID, EOS_ID, MASK_ID, UNK_ID = range(len(SPECIAL_TOKENS))
VOCAB: dict[str, int] = {token: i for i, token in enumerate((*SPECIAL_TOKENS, *ALPHABET))}
ID_TO_TOKEN: dict[int, str] = {i: token for token, i in VOCAB.items()}
VOCAB_SIZE = len(VOCAB)


class UnknownCharacterError(ValueError):
    """The text holds a character the tiny model's alphabet does not have."""


def encode(text: str) -> list[int]:
    """Token ids of `text`, one per character."""
    try:
        return [VOCAB[ch] for ch in text]
    except KeyError:
        bad = sorted({ch for ch in text if ch not in VOCAB})
        raise UnknownCharacterError(
            f"characters {bad!r} are not in the tiny model's alphabet {ALPHABET!r}"
        ) from None


def decode(ids: list[int]) -> str:
    """Text of `ids`; special tokens are dropped, as `skip_special_tokens=True` does."""
    return "".join(ID_TO_TOKEN[i] for i in ids if i >= len(SPECIAL_TOKENS))


def build_tokenizer() -> Tokenizer:
    """A WordLevel tokenizer over single characters with the special tokens registered."""
    tokenizer = Tokenizer(models.WordLevel(vocab=dict(VOCAB), unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS]
    )
    return tokenizer


# The model knows no roles: a chat turn is the task prompt of the user's messages.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
)


def save_tokenizer(directory: str | Path, *, max_length: int) -> None:
    """Writes `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(directory / "tokenizer.json"))
    roles = {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "mask_token": MASK_TOKEN,
        "unk_token": UNK_TOKEN,
    }
    write_tokenizer_config(
        directory,
        {token: VOCAB[token] for token in SPECIAL_TOKENS},
        roles,
        tokenizer_class="PreTrainedTokenizerFast",
        clean_up_tokenization_spaces=False,
        model_max_length=max_length,
        chat_template=CHAT_TEMPLATE,
    )
