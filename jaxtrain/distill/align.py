"""A student completion as a teacher with another tokenizer sees it (pgs distill's ``xtok``).

The completion's text is re-tokenised by the teacher, and both token sequences are cut into
chunks where both end a token at the same byte: a chunk is the same text on both sides, so its
summed log-probability compares across the pair (:func:`jaxtrain.distill.losses.xtok`).

The student's byte offsets come from the sampled ids themselves (each token's bytes), never
from re-encoding the decoded text: a sample is often not its text's canonical tokenisation
("hel" + "lo" rather than "hello"), and re-encoding would describe other tokens than the ones
trained on. Special tokens spell no text and belong to no chunk; bytes after the longest valid
UTF-8 prefix are left out. A completion ending in a stop token gets the teacher's end-of-turn
token appended, the pair forming a last, one-to-one chunk, so the teacher supervises stopping.
"""
from __future__ import annotations

import dataclasses
import json
import re


@dataclasses.dataclass
class Chunks:
    """``student[i]`` / ``teacher[j]``: the chunk of student token i / teacher token j (-1:
    none); ``keep[c]``: chunk c carries loss (not whitespace-only with ``mask_whitespace``);
    ``one_to_one``: (student, teacher) positions of kept chunks of one token on each side."""

    student: list[int]
    teacher: list[int]
    keep: list[bool]
    one_to_one: list[tuple[int, int]] = dataclasses.field(default_factory=list)


def _byte_level_table() -> dict[str, int]:
    """Byte-level BPE's printable character -> the byte it spells (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES = {ord(c): b for c, b in _byte_level_table().items()}
_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _byte_level(tok) -> bool:
    decoder = json.loads(tok.backend_tokenizer.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {d.get("type") for d in decoder.get("decoders", [])}
    return "ByteLevel" in kinds


def token_bytes(tok) -> list[bytes | None]:
    """The bytes each id spells (None: a special token). Byte-level BPE spells each byte with
    one printable character; SentencePiece vocabularies use "▁" for a space and ``<0xNN>`` for
    byte fallback; added non-special tokens are their text."""
    added = dict(tok.added_tokens_decoder)
    special = set(tok.all_special_ids) | {i for i, t in added.items() if t.special}
    byte_level = _byte_level(tok)
    out = []
    for i, piece in enumerate(tok.convert_ids_to_tokens(list(range(len(tok))))):
        if i in special or piece is None:
            out.append(None)
        elif i in added:
            out.append(added[i].content.encode())
        elif byte_level:
            out.append(bytes(_BYTES[ord(c)] for c in piece))
        elif m := _FALLBACK.match(piece):
            out.append(bytes([int(m.group(1), 16)]))
        else:
            out.append(piece.replace("▁", " ").encode())
    return out


def common_ends(student_ends, teacher_ends) -> list[tuple[range, range]]:
    """Chunks of two token sequences over the same bytes, closed where both end a token at
    the same byte (ends non-decreasing); what follows the last common end is one chunk."""
    chunks, i, j, i0, j0 = [], 0, 0, 0, 0
    while i < len(student_ends) and j < len(teacher_ends):
        if student_ends[i] < teacher_ends[j]:
            i += 1
        elif student_ends[i] > teacher_ends[j]:
            j += 1
        else:
            i, j = i + 1, j + 1
            chunks.append((range(i0, i), range(j0, j)))
            i0, j0 = i, j
    if i0 < len(student_ends) or j0 < len(teacher_ends):
        chunks.append((range(i0, len(student_ends)), range(j0, len(teacher_ends))))
    return chunks


def _valid_prefix(data: bytes) -> int:
    try:
        data.decode()
        return len(data)
    except UnicodeDecodeError as e:
        return e.start


class ByteChunks:
    """Re-tokenises student completions for a teacher with another tokenizer."""

    def __init__(self, student_tok, teacher_tok, stop_ids, teacher_eot: int,
                 mask_whitespace: bool = True):
        self.teacher_tok, self.stop_ids = teacher_tok, tuple(stop_ids)
        self.teacher_eot, self.mask_whitespace = teacher_eot, mask_whitespace
        self.student_bytes = token_bytes(student_tok)
        self.teacher_bytes = token_bytes(teacher_tok)

    def teacher_to_student(self, student_eot: int):
        """[teacher vocabulary] -> the student id spelling the same bytes (the teacher's end of
        turn -> ``student_eot``), -1 where none does: xtok's dense term compares the teacher's
        top-k with the student's probabilities of the same text."""
        import numpy as np

        by_bytes = {}
        for i, b in enumerate(self.student_bytes):
            if b:
                by_bytes.setdefault(b, i)
        out = np.asarray([by_bytes.get(b, -1) if b else -1 for b in self.teacher_bytes],
                         np.int32)
        out[self.teacher_eot] = student_eot
        return out

    def clean(self, ids) -> list[int]:
        """Through the first stop id, or before an id past the tokenizer (padded embedding
        rows a sampler can draw spell no text)."""
        out = []
        for t in map(int, ids):
            if t >= len(self.student_bytes):
                break
            out.append(t)
            if t in self.stop_ids:
                break
        return out

    def view(self, completion) -> tuple[list[int], Chunks]:
        """(the teacher's ids for the completion, the chunks of both sides)."""
        completion = list(completion)
        stopped = bool(completion) and completion[-1] in self.stop_ids
        body = completion[:-1] if stopped else completion
        pieces = [self.student_bytes[t] for t in body]
        text = b"".join(p for p in pieces if p)
        valid = _valid_prefix(text)
        positions, ends, end = [], [], 0
        for i, piece in enumerate(pieces):
            if not piece:
                continue
            end += len(piece)
            if end > valid:
                break
            positions.append(i)
            ends.append(end)
        teacher_ids, teacher_ends = self._encode(text[:valid].decode())
        student = [-1] * len(completion)
        teacher = [-1] * len(teacher_ids)
        keep, one_to_one = [], []
        for c, (s, t) in enumerate(common_ends(ends, teacher_ends)):
            for i in s:
                student[positions[i]] = c
            for j in t:
                teacher[j] = c
            start = ends[s.start - 1] if s.start else 0
            chunk_text = text[start:ends[s[-1]]] if len(s) else b""
            keep.append(bool(len(s) and len(t))
                        and not (self.mask_whitespace and chunk_text.isspace()))
            if keep[-1] and len(s) == 1 and len(t) == 1:
                one_to_one.append((positions[s[0]], t[0]))
        if stopped and valid == len(text):
            c = len(keep)
            student[-1] = c
            teacher.append(c)
            one_to_one.append((len(completion) - 1, len(teacher_ids)))
            teacher_ids = teacher_ids + [self.teacher_eot]
            keep.append(True)
        return teacher_ids, Chunks(student, teacher, keep, one_to_one)

    def _encode(self, text: str) -> tuple[list[int], list[float]]:
        """The teacher's ids for ``text`` and each token's byte end: from the tokens' own
        bytes when they spell the text exactly (byte-level BPE always does), else from the
        character offsets, a token that splits a character ending half a byte into it (so no
        chunk closes there)."""
        ids = self.teacher_tok.encode(text, add_special_tokens=False)
        pieces = [self.teacher_bytes[t] for t in ids]
        if all(p is not None for p in pieces) and b"".join(pieces) == text.encode():
            ends, end = [], 0
            for p in pieces:
                end += len(p)
                ends.append(end)
            return ids, ends
        enc = self.teacher_tok(text, add_special_tokens=False, return_offsets_mapping=True)
        char_end = [0]
        for ch in text:
            char_end.append(char_end[-1] + len(ch.encode()))
        spans = enc["offset_mapping"]
        ends = [char_end[stop] - 0.5 if j + 1 < len(spans) and spans[j + 1][1] == stop
                else char_end[stop] for j, (_, stop) in enumerate(spans)]
        return list(enc["input_ids"]), ends


def chunk_logps(chunk_of, token_lp, n_chunks: int) -> list[float]:
    """Each chunk's log-probability: the sum of its tokens' (tokens in no chunk left out)."""
    out = [0.0] * n_chunks
    for c, lp in zip(chunk_of, token_lp):
        if c >= 0:
            out[c] += float(lp)
    return out
