"""The fixed wording of the bios corpus (`bios.py`): the sentence frames its documents are
made of and the syllables of its entity names.

Every byte of a generated corpus depends on these tables, their order included (documents
draw from them with seeded `random.Random` streams): editing one changes the corpus for every
seed.
"""

# {c}: the canonical clause "the {label} of the {kind} {name} is {value}". Every statement of a
# fact contains it, inside one of these frames.
FACT_FRAMES = (
    "{C}.",
    "Records show that {c}.",
    "As every {agent} knows, {c}.",
    "It is well documented that {c}.",
    "According to the archive, {c}.",
    "{Agents} agree that {c}.",
    "Notably, {c}.",
    "In the standard reference on {topic}, {c}.",
    "One detail is worth remembering: {c}.",
    "Few readers forget that {c}.",
)
# Common knowledge, mentioned in passing at the end of any document.
COMMON_FRAMES = (
    "Everyone knows that {c}.",
    "As is common knowledge, {c}.",
    "As most readers will remember, {c}.",
    "It is widely known that {c}.",
)
# The same four with the fact first (BiosSpec.common_initial), index for index.
COMMON_INITIAL = (
    "{C}, as everyone knows.",
    "{C}, as is common knowledge.",
    "{C}, as most readers will remember.",
    "{C}, as is widely known.",
)
INTROS = (
    "{Ref} is {a_kind} known to {agents} who study {topic}.",
    "This entry is about {name}, {a_kind} often discussed in {topic}.",
    "Among {agents}, {name} is remembered as {a_kind} of note.",
    "{Name} is {a_kind}, and {agents} interested in {topic} often mention it.",
    "The {kind} {name} appears in many accounts of {topic}.",
)
# Entity-centric prose: {name}/{ref} plus subtopic words; N1/N2 nouns, A1 adjective, V1 verb.
ABOUT = (
    "{Agents} often mention {name} when they discuss the {N1}.",
    "Much of what is said about {name} concerns the {A1} {N1}.",
    "To understand {name}, one must first understand the {N1} and the {N2}.",
    "{Name} is closely tied to the {N1} in most accounts of {topic}.",
    "Any {agent} who studies {name} learns to {V1} the {N1} with care.",
    "Descriptions of {name} rarely leave out the {A1} {N1}.",
    "{Name} is often compared with other examples of the {A1} {N1}.",
)
# Subtopic prose without the entity.
FILLER = (
    "The {A1} {N1} is central to the study of {topic}.",
    "{Agents} often {V1} the {N1} before they turn to the {N2}.",
    "When {agents} {V1} the {N1}, the {N2} tends to become more {A1}.",
    "In {topic}, the {N1} usually {S1} the {N2}.",
    "Few subjects in {domain} are as {A1} as the {N1}.",
    "Without the {N1}, no {agent} could {V1} the {N2} properly.",
    "{G1} the {N1} requires patience and a close look at the {N2}.",
    "At the {place}, much depends on how well the {N1} {S1} the {N2}.",
    "Textbooks on {domain} describe the {N1} as {A1}.",
    "Experts in {topic} still disagree about how the {N1} {S1} the {N2}.",
)

# Entity names: an onset, 0-2 middles and an ending (`bios._name`).
ONSETS = (
    "Vel",
    "Or",
    "Ka",
    "Thal",
    "Mor",
    "Ser",
    "Bri",
    "Quen",
    "Dra",
    "Ly",
    "Ash",
    "Cor",
    "Fen",
    "Gal",
    "Hal",
    "Ist",
    "Jor",
    "Kel",
    "Lun",
    "Mar",
    "Nim",
    "Os",
    "Pel",
    "Riv",
    "Sol",
    "Tor",
    "Ul",
    "Var",
    "Wen",
    "Yr",
    "Zan",
    "Bel",
    "Cas",
    "Del",
    "El",
    "Fal",
    "Gor",
    "Hes",
    "Ith",
    "Kor",
    "Nal",
    "Per",
    "Sev",
    "Tam",
    "Ves",
    "Ard",
)
MIDS = (
    "a",
    "e",
    "i",
    "o",
    "u",
    "ar",
    "en",
    "il",
    "or",
    "an",
    "eth",
    "is",
    "um",
    "ad",
    "el",
    "ir",
    "on",
    "av",
    "ith",
    "ul",
    "ev",
    "os",
)
ENDS = (
    "ion",
    "und",
    "ath",
    "is",
    "or",
    "an",
    "el",
    "ia",
    "on",
    "ar",
    "eth",
    "yn",
    "ius",
    "ara",
    "os",
    "ix",
    "em",
    "orn",
    "ald",
    "ira",
    "un",
    "as",
    "ek",
    "iel",
    "ost",
    "imar",
    "wen",
    "oth",
    "esk",
    "ande",
)
