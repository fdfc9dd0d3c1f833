"""Tokenizer backends against HF transformers / sentencepiece goldens; incremental detokenizer;
chat templates; errors. Goldens: tests/fixtures (written by tools/make_reference.py)."""

import json
import random
import shutil

import gguf
import pytest
import sentencepiece
from testpaths import FIXTURES, sentencepiece_model_path, smollm2_gguf_path

from jaxinfer.tokenizer import (
    HFTokenizer,
    IncrementalDetokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    TokenizerError,
    from_gguf_metadata,
    load_tokenizer,
)
from jaxinfer.tokenizer.chat_template import ChatTemplateError, render_chat_template

TEXTS = json.loads((FIXTURES / "tokenizer_texts.json").read_text())
SMOLLM_GOLDEN = json.loads((FIXTURES / "smollm2" / "tokenizer_golden.json").read_text())
CHAT_GOLDEN = json.loads((FIXTURES / "smollm2" / "chat_golden.json").read_text())
SP_GOLDEN = json.loads((FIXTURES / "sentencepiece_golden.json").read_text())["cases"]
SP_CONTROL = ("<s>", "</s>", "<unk>")  # matched whole by our backend, not by bare sentencepiece


@pytest.fixture(scope="module")
def smollm_gguf():
    return load_tokenizer(smollm2_gguf_path())


@pytest.fixture(scope="module")
def smollm_json():
    return load_tokenizer(FIXTURES / "smollm2")


@pytest.fixture(scope="module")
def sp_processor():
    return sentencepiece.SentencePieceProcessor(model_file=str(sentencepiece_model_path()))


@pytest.fixture(scope="module")
def sp_tokenizer():
    return load_tokenizer(sentencepiece_model_path())


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory, sp_processor):
    """A GGUF holding only a "llama" (sentencepiece) vocabulary: Mistral's, as llama.cpp stores it."""
    sp, n = sp_processor, sp_processor.get_piece_size()
    path = tmp_path_factory.mktemp("gguf") / "mistral-vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    writer.add_token_types(
        [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    )
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def llama_gguf_tokenizer(llama_gguf):
    return load_tokenizer(llama_gguf)


@pytest.fixture(scope="module")
def llama_style_json(tmp_path_factory, sp_processor):
    """A Llama-2-style tokenizer.json (BPE, byte fallback, "▁" normalizer, Strip decoder) over
    Mistral's vocabulary, as HF's converter writes one: merges ranked by piece score."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as RawTokenizer

    sp, n = sp_processor, sp_processor.get_piece_size()
    vocab = {sp.id_to_piece(i): i for i in range(n)}
    ranked = sorted(
        (-sp.get_score(i), vocab[p[:c]], vocab[p[c:]], p[:c], p[c:])
        for i in range(n)
        if sp.is_control(i) + sp.is_byte(i) + sp.is_unknown(i) == 0
        for p in [sp.id_to_piece(i)]
        for c in range(1, len(p))
        if p[:c] in vocab and p[c:] in vocab
    )
    raw = RawTokenizer(
        models.BPE(
            vocab=vocab, merges=[(a, b) for *_, a, b in ranked], unk_token="<unk>", fuse_unk=True, byte_fallback=True
        )
    )
    raw.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    raw.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SP_CONTROL])
    model_dir = tmp_path_factory.mktemp("llama_style")
    raw.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return load_tokenizer(model_dir)


# ---- SmolLM2: GGUF vocabulary and tokenizer.json against HF transformers ---------------------


@pytest.mark.parametrize("which", ["smollm_gguf", "smollm_json"])
def test_smollm2_ids_match_hf(which, request):
    tok = request.getfixturevalue(which)
    assert len(SMOLLM_GOLDEN) == len(TEXTS)
    for case in SMOLLM_GOLDEN:
        text = case["text"]
        assert tok.encode(text, add_special_tokens=False) == case["ids"], text
        assert tok.encode(text) == case["ids_special"], text
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["decoded"], text


@pytest.mark.parametrize("which", ["smollm_gguf", "smollm_json"])
def test_smollm2_special_tokens(which, request):
    tok = request.getfixturevalue(which)
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_ids, tok.pad_token_id) == (1, (2,), 2)
    assert tok.add_bos is False
    assert tok.id_to_token(2) == "<|im_end|>" and tok.id_to_token(905) == "Ġworld"
    assert all(tok.is_special(i) for i in range(17)) and not tok.is_special(17)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_round_trip(smollm_gguf, sp_tokenizer, llama_gguf_tokenizer):
    for tok in (smollm_gguf, sp_tokenizer, llama_gguf_tokenizer):
        for text in TEXTS:
            ids = tok.encode(text, add_special_tokens=False)
            assert tok.decode(ids, skip_special_tokens=False) == text, (tok, text)
            if "<" not in text:
                assert tok.decode(tok.encode(text)) == text, (tok, text)


@pytest.mark.parametrize("which", ["smollm_gguf", "llama_gguf_tokenizer", "sp_tokenizer"])
def test_save_pretrained_reads_back_equal(which, request, tmp_path):
    """What `jaxinfer convert` exports beside a GGUF's weights reads back as the same tokenizer."""
    tok = request.getfixturevalue(which)
    tok.save_pretrained(tmp_path)
    back = load_tokenizer(tmp_path)
    assert type(back) is type(tok) and back.vocab_size == tok.vocab_size
    for attr in ("bos_token_id", "eos_token_ids", "pad_token_id", "add_bos", "add_eos", "chat_template"):
        assert getattr(back, attr) == getattr(tok, attr), attr
    assert [i for i in range(tok.vocab_size) if back.is_special(i)] == [
        i for i in range(tok.vocab_size) if tok.is_special(i)
    ]
    for text in TEXTS:
        ids = tok.encode(text)
        assert back.encode(text) == ids, text
        assert back.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    if tok.chat_template:
        messages = [{"role": "user", "content": "hi"}]
        assert back.apply_chat_template(messages) == tok.apply_chat_template(messages)


def test_from_gguf_metadata_plain_dict(smollm_gguf):
    fields = gguf.GGUFReader(str(smollm2_gguf_path())).fields
    plain = {k: f.contents() for k, f in fields.items() if k.startswith("tokenizer.")}
    tok = from_gguf_metadata(plain, name="smollm2 metadata")
    text = TEXTS[19]
    assert tok.encode(text) == smollm_gguf.encode(text) and tok.eos_token_ids == (2,)


# ---- sentencepiece: the .model file and a GGUF "llama" vocabulary against sentencepiece ------


@pytest.mark.parametrize("which", ["sp_tokenizer", "llama_gguf_tokenizer", "llama_style_json"])
def test_sentencepiece_ids_match(which, request, sp_processor):
    tok = request.getfixturevalue(which)
    assert isinstance(tok, HFTokenizer if which == "llama_style_json" else SentencePieceTokenizer)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (32000, 1, (2,), True)
    checked = 0
    for case in SP_GOLDEN:
        text = case["text"]
        if any(s in text for s in SP_CONTROL):
            continue
        assert tok.encode(text, add_special_tokens=False) == case["ids"], text
        assert tok.encode(text) == [1] + case["ids"], text
        assert tok.decode(case["ids"]) == case["decoded"], text
        checked += 1
    assert checked == len(SP_GOLDEN) - 1
    # Control pieces written in the text are whole tokens; the text between them is encoded by
    # sentencepiece run by run (each with its "▁" prefix), as llama.cpp does.
    text = "<s>[INST] hi [/INST]</s> <unk>"
    expected = [1, *sp_processor.encode("[INST] hi [/INST]"), 2, *sp_processor.encode(" "), 0]
    assert tok.encode(text, add_special_tokens=False) == expected
    if which != "llama_style_json":  # HF's legacy decoders keep the "▁" after a control piece
        assert tok.decode(expected, skip_special_tokens=False) == text
    assert tok.decode(expected) == sp_processor.decode([i for i in expected if i > 2])


def test_sentencepiece_decode_inverts_encode_around_control(sp_tokenizer):
    hello = 22557  # "▁Hello": each run of text between control pieces starts with "▁"
    assert sp_tokenizer.encode("Hello</s>Hello", add_special_tokens=False) == [hello, 2, hello]
    assert sp_tokenizer.decode([hello, 2, hello], skip_special_tokens=False) == "Hello</s>Hello"
    assert sp_tokenizer.decode([hello, 2, hello]) == "Hello Hello"  # as sentencepiece does
    assert sp_tokenizer.decode([1, hello]) == "Hello"


# ---- incremental detokenizer ----------------------------------------------------------------

BACKENDS = ["smollm_gguf", "smollm_json", "sp_tokenizer", "llama_gguf_tokenizer", "llama_style_json"]


def _stream(tok, ids, chunks, skip, prompt=None):
    detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
    pieces, at = [], 0
    for size in chunks:
        pieces.append(detok.step(ids[at : at + size]))
        at += size
    assert at == len(ids)
    return pieces, detok.flush()


@pytest.mark.parametrize("which", BACKENDS)
def test_incremental_equals_one_shot(which, request):
    tok = request.getfixturevalue(which)
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            expected = tok.decode(ids, skip_special_tokens=skip)
            for chunks in ([1] * len(ids), _random_chunks(rng, len(ids))):
                pieces, tail = _stream(tok, ids, chunks, skip)
                assert "".join(pieces) + tail == expected, (text, skip, chunks)
                if "\ufffd" not in expected:
                    assert not any("\ufffd" in p for p in pieces), (text, pieces)


@pytest.mark.parametrize("which", BACKENDS)
def test_incremental_after_prompt_keeps_leading_space(which, request):
    tok = request.getfixturevalue(which)
    prompt = tok.encode("Answer:")
    for text in TEXTS:
        ids = tok.encode(" " + text, add_special_tokens=False)
        # Encoding the text after the prompt may differ from the whole; decode what was streamed.
        whole, before = tok.decode(prompt + ids), tok.decode(prompt)
        assert whole.startswith(before)
        pieces, tail = _stream(tok, ids, [1] * len(ids), True, prompt=prompt)
        assert "".join(pieces) + tail == whole[len(before) :], text


def test_incremental_holds_split_characters(smollm_gguf):
    ids = smollm_gguf.encode("a😀b")  # the emoji is three byte-level tokens
    detok = IncrementalDetokenizer(smollm_gguf)
    out = [detok.step([i]) for i in ids]
    assert out == ["a", "", "", "😀", "b"] and detok.flush() == ""
    detok = IncrementalDetokenizer(smollm_gguf)
    assert detok.step(ids[:1]) == "a" and detok.step(ids[1:2]) == ""
    assert detok.flush() == "\ufffd"  # an unfinished character


def test_incremental_window_is_bounded(sp_tokenizer):
    """Each step decodes a few ids, not the whole sequence."""
    seen = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def decode(self, ids, skip_special_tokens=True):
            seen.append(len(ids))
            return self.inner.decode(ids, skip_special_tokens)

        def is_special(self, i):
            return self.inner.is_special(i)

    ids = sp_tokenizer.encode(" ".join(TEXTS) * 8)
    assert len(ids) > 2000
    pieces, tail = _stream(Counting(sp_tokenizer), ids, [1] * len(ids), True)
    assert "".join(pieces) + tail == sp_tokenizer.decode(ids)
    assert max(seen) <= 16


def _random_chunks(rng, n):
    chunks = []
    while n:
        chunks.append(min(n, rng.randint(0, 5)))
        n -= chunks[-1]
    return chunks


# ---- chat templates -------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["smollm_gguf", "smollm_json"])
def test_chat_template_matches_hf(which, request):
    tok = request.getfixturevalue(which)
    assert tok.chat_template.strip() == CHAT_GOLDEN["chat_template"].strip()
    for case in CHAT_GOLDEN["cases"]:
        assert tok.apply_chat_template(case["messages"]) == case["add_generation_prompt_true"]
        assert (
            tok.apply_chat_template(case["messages"], add_generation_prompt=False)
            == case["add_generation_prompt_false"]
        )


def test_chat_template_from_gguf_uses_bos_token(llama_gguf_tokenizer):
    text = llama_gguf_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<s>[INST] hi [/INST]"
    assert llama_gguf_tokenizer.encode(text, add_special_tokens=False)[0] == 1


def test_chat_template_without_template_names_the_tokenizer(sp_tokenizer):
    with pytest.raises(TokenizerError, match="tokenizer.model.v1.*no chat template"):
        sp_tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_environment():
    assert render_chat_template("{{ messages | tojson }}", [{"content": "<é>"}]) == '[{"content": "<é>"}]'
    assert (
        render_chat_template(
            "  {% for m in messages %}\n{{ m.content }}\n  {% endfor %}", [{"content": "a"}, {"content": "b"}]
        )
        == "a\nb\n"
    )
    assert render_chat_template("{% generation %}x{% endgeneration %}{{ strftime_now('%Y')|length }}", []) == "x4"
    with pytest.raises(ChatTemplateError, match="no system role"):
        render_chat_template("{{ raise_exception('no system role') }}", [])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute escapes
        render_chat_template("{{ messages.__class__.__mro__ }}", [])


def test_model_dir_configs(tmp_path):
    """tokenizer_config / generation_config / named chat templates decide BOS, EOS, template."""
    shutil.copy(FIXTURES / "smollm2" / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "add_bos_token": True,
                "bos_token": {"content": "<|im_start|>"},
                "eos_token": "<|endoftext|>",
                "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 2]}))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert tok.add_bos and tok.bos_token_id == 1 and tok.eos_token_ids == (0, 2)
    assert tok.encode("hi") == [1, 6004] and tok.encode("hi", add_special_tokens=False) == [6004]
    assert tok.apply_chat_template([]) == "D"


# ---- errors ---------------------------------------------------------------------------------


def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")


def test_directory_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=f"no tokenizer in {tmp_path}"):
        load_tokenizer(tmp_path)


@pytest.mark.parametrize(
    "name, data",
    [
        ("tokenizer.json", b'{"version": "1.0", "model": {"type": "BPE", "vocab": '),
        ("tokenizer.model", b"\x00not a sentencepiece model"),
        ("model.gguf", b"GGUF\x03\x00\x00\x00garbage"),
    ],
)
def test_corrupt_files_are_named(tmp_path, name, data):
    (tmp_path / name).write_bytes(data)
    with pytest.raises(TokenizerError, match=str(tmp_path / name)):
        load_tokenizer(tmp_path)


def test_corrupt_config_is_named(tmp_path):
    shutil.copy(FIXTURES / "smollm2" / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        load_tokenizer(tmp_path)


def test_gguf_without_vocabulary(tmp_path):
    path = tmp_path / "novocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TokenizerError, match="novocab.gguf has no tokenizer"):
        load_tokenizer(path)
