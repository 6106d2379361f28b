"""The tokenizer of a Hugging Face BERT folder for `import-hf` (`hf.py`): its vocab.txt with the casing of its
tokenizer_config.json, refusing what our WordPiece would tokenize otherwise than transformers' BertTokenizer
(renamed special tokens, another tokenizer class or basic tokenization, added tokens beyond vocab.txt)."""
from __future__ import annotations

import json
import os
from typing import Any

from tupe_jax.data.fairseq_bpe import KIND as FAIRSEQ_KIND
from tupe_jax.data.tokenizer import CONFIG_NAME, SPECIALS, Tokenizer
from tupe_jax.errors import UserError, require

WHERE = "--from"
SPECIAL_KEYS = dict(zip(("pad_token", "unk_token", "cls_token", "sep_token", "mask_token"), SPECIALS))
# tokenizer_config.json keys whose other values our tokenizer does not reproduce (None: the key left out)
TOKENIZER_AS_BERTS = {"tokenizer_class": (None, "BertTokenizer", "BertTokenizerFast", FAIRSEQ_KIND),
                      "tokenize_chinese_chars": (None, True), "do_basic_tokenize": (None, True),
                      "never_split": (None, [])}


def read_tokenizer(src: str, where: str = WHERE) -> Tokenizer:
    """The folder's vocab.txt with the casing of its tokenizer_config.json; refuses renamed special tokens."""
    path = os.path.join(src, "vocab.txt")
    require(os.path.isfile(path), f"{src} has no vocab.txt", where, "add the model's WordPiece vocab.txt")
    cfg_path = os.path.join(src, CONFIG_NAME)
    tok_cfg = _json(cfg_path, where)
    for named in (cfg_path, os.path.join(src, "special_tokens_map.json")):   # transformers reads both
        found = tok_cfg if named == cfg_path else _json(named, where)
        require(found is None or isinstance(found, dict), f"{named} holds a JSON {type(found).__name__}, not an "
                "object", where, "fix or remove it")
        for key, wanted in SPECIAL_KEYS.items():
            value = (found or {}).get(key)
            value = value.get("content") if isinstance(value, dict) else value
            require(value in (None, wanted), f"{named} names {key} {value!r}, not {wanted!r}", where,
                    f"only the BERT special tokens {' '.join(SPECIALS)} are supported")
    if tok_cfg is not None:
        for key, ok in TOKENIZER_AS_BERTS.items():   # what our WordPiece does; anything else would change the ids
            require(tok_cfg.get(key) in ok, f"{cfg_path} has {key}={tok_cfg.get(key)!r}", where,
                    "only BERT's own tokenizer (BertTokenizer: basic tokenization with Chinese characters split, "
                    "then WordPiece) is supported")
    tokenizer = Tokenizer.from_file(path)
    _refuse_added_tokens(src, list(getattr(tokenizer, "vocab", [])), tok_cfg or {}, where)
    return tokenizer


def _json(path: str, where: str) -> Any:
    """The JSON file at `path` (None when there is none); invalid JSON is a one-line error."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err})", where, "fix or remove it") from None


def _refuse_added_tokens(src: str, vocab: list[str], tok_cfg: dict, where: str) -> None:
    """Tokens a transformers tokenizer adds beyond vocab.txt (added_tokens.json, tokenizer_config.json's
    added_tokens_decoder, tokenizer.json's added_tokens) are whole tokens there; our WordPiece reads vocab.txt alone
    and would split them, giving other ids. Ones that are vocab.txt's own lines at their ids (BERT's specials) are
    fine."""
    index = {token: i for i, token in reversed(list(enumerate(vocab)))}   # vocab.txt as the tokenizer read it
    added_file = _json(os.path.join(src, "added_tokens.json"), where)
    fast = _json(os.path.join(src, "tokenizer.json"), where)
    added: list[tuple[str, Any]] = list(added_file.items()) if isinstance(added_file, dict) else []
    if isinstance(tok_cfg.get("added_tokens_decoder"), dict):
        added += [(t.get("content"), _int(i)) for i, t in tok_cfg["added_tokens_decoder"].items()
                  if isinstance(t, dict)]
    if isinstance(fast, dict) and isinstance(fast.get("added_tokens"), list):
        added += [(t.get("content"), t.get("id")) for t in fast["added_tokens"] if isinstance(t, dict)]
    extra = sorted({(str(tok), str(i)) for tok, i in added if not isinstance(tok, str) or index.get(tok) != i},
                   key=str)
    shown = ", ".join(f"{t!r} id {i}" for t, i in extra[:3])
    require(not extra, f"{src}'s tokenizer adds {len(extra)} token(s) beyond vocab.txt ({shown}): our WordPiece "
            "reads vocab.txt alone and would split them", where,
            "add them to vocab.txt at the ids the embeddings give them, or import a folder without added tokens")
    words = ((fast or {}).get("model") or {}).get("vocab") if isinstance(fast, dict) else None
    if isinstance(words, dict):   # the fast tokenizer's own WordPiece table, which transformers prefers
        bad = next((t for t in words if index.get(t) != words[t]), None)
        what = f"{bad!r} has id {words[bad]} there, {index.get(bad)} in vocab.txt" if bad is not None else None
        if len(words) != len(vocab):
            what = f"{len(words)} tokens, vocab.txt {len(vocab)}"
        require(what is None, f"{src}/tokenizer.json's vocabulary differs from vocab.txt ({what})", where,
                "give the vocab.txt of that tokenizer.json (transformers tokenizes with tokenizer.json)")


def _int(value: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return value
