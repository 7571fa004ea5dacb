"""English morphology for the topical-prose corpus: verb forms, articles by sound, capitals.

Verbs are stored in base form in the vocabulary; the generator conjugates them here. The rules
are approximate but cover every word of `data/topical_vocab.json`; changing one changes the
corpus's bytes. (`bios.py` keeps its own, simpler rules for the same reason.)
"""

from __future__ import annotations

__all__ = ["VOWELS", "article", "cap", "gerund", "third_person", "with_article"]

VOWELS = "aeiou"
# Multi-syllable verbs stressed on the last syllable double their final consonant.
_DOUBLE_FINAL = frozenset(
    (
        "expel",
        "control",
        "outwit",
        "patrol",
        "compel",
        "propel",
        "deter",
        "repel",
        "refer",
        "transfer",
        "equip",
        "regret",
        "submit",
        "admit",
        "permit",
        "commit",
        "transmit",
        "retransmit",
        "occur",
        "rebel",
        "acquit",
    )
)


def third_person(v: str) -> str:
    if v.endswith(("s", "sh", "ch", "x", "z")):
        return v + "es"
    if v.endswith("y") and len(v) > 1 and v[-2] not in VOWELS:
        return v[:-1] + "ies"
    return v + "s"


def _syllables(v: str) -> int:
    groups, prev = 0, False
    for i, c in enumerate(v):
        vow = c in VOWELS or (c == "y" and i > 0 and v[i - 1] not in VOWELS)
        if vow and not prev:
            groups += 1
        prev = vow
    return groups


def gerund(v: str) -> str:
    if v.endswith("ie"):
        return v[:-2] + "ying"
    if v.endswith(("ee", "ye", "oe")):
        return v + "ing"
    if v.endswith("e") and len(v) > 2:
        return v[:-1] + "ing"
    cvc = len(v) >= 3 and v[-1] not in VOWELS + "wxy" and v[-2] in VOWELS and v[-3] not in VOWELS
    if v in _DOUBLE_FINAL or (cvc and _syllables(v) == 1):
        return v + v[-1] + "ing"
    return v + "ing"


_AN_LETTER_NAMES = frozenset("AEFHILMNORSX")  # initialisms whose first letter sounds like a vowel
# Vowel-initial spellings pronounced with a consonant ("a uniform", "a one-eyed").
_A_PREFIXES = ("unif", "union", "uniq", "unit", "univ", "use", "usu", "uti", "ura", "eu", "one")


def article(phrase: str) -> str:
    """'a' or 'an' for a phrase, by (approximate) sound rather than spelling."""
    word = phrase.split()[0]
    core = word.split("-")[0]
    if len(core) > 1 and core.isupper():
        return "an" if core[0] in _AN_LETTER_NAMES else "a"
    lw = word.lower()
    if lw.startswith(_A_PREFIXES):
        return "a"
    if lw.startswith(("hour", "honest", "honor", "heir")):
        return "an"
    return "an" if lw[0] in VOWELS else "a"


def with_article(phrase: str) -> str:
    return f"{article(phrase)} {phrase}"


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]
