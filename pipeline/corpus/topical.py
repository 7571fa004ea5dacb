"""The embedded default corpus: synthetic, topical English prose with long-tail facts.

Why it exists
-------------
memtree must run end to end (embed → hierarchical k-means → memory blocks → pretraining →
knowledge evaluation) on a machine with no network access, and its tests need a corpus whose
structure is *known*. A random-word corpus would not do: MiniLM embeddings of noise do not
cluster, so the memory tree would be meaningless. This module therefore writes real-looking
English documents with a known two-level topic hierarchy and a known set of facts, using only
the standard library and `random.Random` seeded from the spec, so that the same `CorpusSpec`
gives byte-identical output on any machine and Python build.

How it is structured
--------------------
* **Topics.** 16 clearly distinct domains (astronomy, cooking, …, railways), each with 4
  subtopics (`DOMAINS`). Every subtopic has its own hand-written vocabulary of nouns, verbs and
  adjectives, and every domain a small general vocabulary (practitioners, places, general
  nouns and adjectives). Documents are prose assembled from ~40 sentence templates of several
  syntactic forms (statements, questions, conditionals, contrasts, gerund and infinitive
  clauses) filled with the subtopic's words, plus a small share (~12%) of the domain's general
  words. A sentence embedder separates the domains sharply and the subtopics clearly, which
  is exactly the shape the hierarchical k-means tree is meant to recover.
* **Balance.** Documents are dealt to the 64 subtopics in shuffled rounds, so every subtopic
  gets `n_docs / 64` documents, ±1.
* **Long-tail knowledge.** Each subtopic has `entities_per_subtopic` fictional entities (names
  built from syllables, unique corpus-wide, never an English word of the vocabulary) with 2–3
  attribute facts each, drawn from per-domain attribute templates ("the star Veltharion has a
  surface temperature of 5,812 kelvin", "Chef Oramund rarely cooks without sumac"). A fact is
  fixed per entity: every statement of it uses the same value, though the phrasing varies.
* **Zipf mentions.** Facts live only in documents of their entity's own subtopic, so that a
  fact lands in one region of the memory tree. Within a subtopic the entities are ranked
  1..k, and each document of the subtopic mentions the entity of rank r independently with
  probability ``0.5 * r ** -zipf_exponent``: the expected number of documents mentioning an
  entity is proportional to ``rank ** -zipf_exponent`` (a Zipf law with the configured
  exponent; head entities appear in about half of their subtopic's documents, tail entities in
  a handful or none). A mention states each of the entity's facts with probability 0.65 (at
  least one). `entity_facts` reports, per fact, exactly how many documents state it, so a
  knowledge benchmark can ask about head and tail facts and know how often each was seen.
  (A single corpus-wide ranking is not used because an entity cannot appear in more documents
  than its subtopic has: with 768 entities such a law would leave almost all of them unseen.)
* **Lengths.** Most documents have 80–600 words (log-uniform); a `long_doc_fraction` share has
  2,600–6,000 words, so one document spans several 2,048-token training windows.

Records are ``{"id": "syn-000000", "text": ..., "domain": ..., "topic": ...}`` where `domain`
and `topic` are the snake_case keys of `DOMAINS`.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import string
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from memtree.config import is_int

__all__ = [
    "DOMAINS",
    "TOPICS",
    "CorpusSpec",
    "entity_facts",
    "generate_corpus",
    "write_corpus_jsonl",
]

# Probability that a document mentions the rank-1 entity of its subtopic; rank r gets
# HEAD_MENTION_PROB * r**-s. Kept below 1 so the Zipf law is never clipped.
HEAD_MENTION_PROB = 0.5
# Probability that a mention states a given fact of the entity (at least one is always stated).
FACT_STATE_PROB = 0.65
# Share of noun / adjective slots filled from the domain's general vocabulary.
GENERAL_NOUN_SHARE = 0.12
GENERAL_ADJ_SHARE = 0.15
SHORT_DOC_WORDS = (80, 560)  # log-uniform target; the final sentence may overshoot a little
LONG_DOC_WORDS = (2600, 6000)


# --------------------------------------------------------------------------------------------
# Spec
# --------------------------------------------------------------------------------------------


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, kw_only=True)
class CorpusSpec:
    """Everything that determines the corpus: the same spec always yields the same bytes.

    n_docs: number of documents. seed: non-negative integer; different seeds give different
    entities, facts, topic order and text. zipf_exponent: exponent s of the per-subtopic Zipf
    law of entity mentions (0 = uniform). entities_per_subtopic: fictional entities per
    subtopic (64 subtopics). long_doc_fraction: share of documents with 2,600–6,000 words.
    """

    n_docs: int = 4000
    seed: int = 0
    zipf_exponent: float = 1.0
    entities_per_subtopic: int = 12
    long_doc_fraction: float = 0.03

    def __post_init__(self) -> None:
        # Validate eagerly: a bad spec would otherwise surface as an obscure error deep
        # inside generation, or worse, as a silently odd corpus.
        n, seed, s = self.n_docs, self.seed, self.zipf_exponent
        e, f = self.entities_per_subtopic, self.long_doc_fraction
        if not is_int(n) or not 1 <= n <= 10_000_000:
            raise ValueError(f"CorpusSpec.n_docs must be an int in [1, 10000000], got {n!r}")
        if not is_int(seed) or seed < 0:
            raise ValueError(f"CorpusSpec.seed must be a non-negative int, got {seed!r}")
        if not _is_real(s) or not 0 <= s <= 10:
            raise ValueError(f"CorpusSpec.zipf_exponent must be a number in [0, 10], got {s!r}")
        # 500 per subtopic (32,000 names) keeps syllable names plentiful and unique.
        if not is_int(e) or not 1 <= e <= 500:
            raise ValueError(
                f"CorpusSpec.entities_per_subtopic must be an int in [1, 500], got {e!r}"
            )
        if not _is_real(f) or not 0 <= f <= 1:
            raise ValueError(f"CorpusSpec.long_doc_fraction must be a number in [0, 1], got {f!r}")


# --------------------------------------------------------------------------------------------
# Vocabulary and attribute tables
# --------------------------------------------------------------------------------------------


def _w(text: str) -> tuple[str, ...]:
    """Split a comma-separated word list (entries may be multi-word phrases)."""
    return tuple(x.strip() for x in text.split(",") if x.strip())


@dataclass(frozen=True)
class _Attr:
    key: str
    label: str
    kind: str  # "int" | "dec" | "year" | "cat"
    phrasings: tuple[str, ...]
    lo: int = 0
    hi: int = 0
    unit: str = ""
    choices: tuple[str, ...] = ()
    article: bool = False  # categorical value is a countable noun: say "an iron sword"
    generic: bool = True  # the generic "the {label} of {ref} is {value}" phrasings read well


def _num(key, label, lo, hi, unit, *phrasings, generic=True) -> _Attr:
    return _Attr(key, label, "int", phrasings, lo=lo, hi=hi, unit=unit, generic=generic)


def _dec(key, label, lo, hi, unit, *phrasings) -> _Attr:
    # lo and hi are in tenths: one decimal place is written ("3.7 solar masses").
    return _Attr(key, label, "dec", phrasings, lo=lo, hi=hi, unit=unit)


def _year(key, label, lo, hi, *phrasings) -> _Attr:
    return _Attr(key, label, "year", phrasings, lo=lo, hi=hi)


def _cat(key, label, choices, *phrasings, article=False) -> _Attr:
    return _Attr(key, label, "cat", phrasings, choices=_w(choices), article=article)


@dataclass(frozen=True)
class _Sub:
    key: str
    label: str
    nouns: tuple[str, ...]
    verbs: tuple[str, ...]
    adjs: tuple[str, ...]


def _sub(key: str, label: str, nouns: str, verbs: str, adjs: str) -> _Sub:
    return _Sub(key, label, _w(nouns), _w(verbs), _w(adjs))


@dataclass(frozen=True)
class _Domain:
    key: str
    label: str
    agents: str  # plural practitioners
    agent: str  # singular practitioner
    places: tuple[str, ...]
    nouns: tuple[str, ...]
    adjs: tuple[str, ...]
    ref: str  # how an entity is referred to, e.g. "the star {name}"
    attrs: tuple[_Attr, ...]
    subs: tuple[_Sub, ...]


# The hand-written tables below keep a compact layout on purpose.
# fmt: off
_SPEC: tuple[_Domain, ...] = (
    _Domain(
        "astronomy", "astronomy", "astronomers", "astronomer",
        _w("observatory, planetarium, mountain observatory, research station"),
        _w("telescope, night sky, light year, orbit, sky survey, star chart, celestial object, "
           "wavelength, spectrum, horizon"),
        _w("celestial, distant, faint, luminous, astronomical"),
        "the star {name}",
        (
            _num("surface_temperature", "surface temperature", 2400, 38000, "kelvin",
                 "{Ref} has a surface temperature of {v}.",
                 "Measurements put the surface of {ref} at {v}."),
            _num("distance", "distance from Earth", 4, 9500, "light years",
                 "{Ref} lies about {v} from Earth.",
                 "Light from {ref} travels {v} before it reaches Earth."),
            _cat("constellation", "constellation",
                 "Cygnus, Lyra, Orion, Cassiopeia, Perseus, Andromeda, Auriga, Draco, Hercules, "
                 "Aquila, Centaurus, Carina, Pegasus, Taurus",
                 "{Ref} can be found in the constellation {v}.",
                 "Observers look for {ref} in {v}."),
            _dec("mass", "mass", 1, 400, "solar masses",
                 "{Ref} contains roughly {v}.",
                 "Astronomers estimate that {ref} weighs in at {v}."),
        ),
        (
            _sub("stellar_evolution", "stellar evolution",
                 "red giant, white dwarf, main sequence, nuclear fusion, stellar core, "
                 "helium flash, "
                 "protostar, supernova, neutron star, stellar wind, hydrogen shell, "
                 "planetary nebula, brown dwarf, carbon core, luminosity class, collapse phase",
                 "ignite, collapse, fuse, expel, exhaust, compress, heat, shed",
                 "massive, dense, degenerate, incandescent, unstable, short-lived, evolved, "
                 "convective"),
            _sub("planetary_science", "planetary science",
                 "crater, ice giant, gas giant, rocky planet, moon, ring system, impact basin, "
                 "magnetosphere, atmosphere, polar cap, lava plain, dust storm, asteroid belt, "
                 "comet tail, regolith, orbital resonance, tidal bulge, ice volcano",
                 "orbit, erode, bombard, resurface, map, sample, scar, shield",
                 "icy, rocky, cratered, volcanic, tidal, frozen, barren, ringed"),
            _sub("galaxies_and_cosmology", "galaxies and cosmology",
                 "spiral arm, galactic halo, dark matter, cosmic background, redshift, "
                 "galaxy cluster, black hole, quasar, big bang, cosmic inflation, dark energy, "
                 "expansion rate, elliptical galaxy, galactic merger, cosmic web, accretion disk, "
                 "gravitational lens",
                 "expand, distort, merge, warp, accelerate, bend, cluster, swallow",
                 "cosmic, primordial, supermassive, expanding, invisible, gravitational, ancient, "
                 "redshifted"),
            _sub("observational_astronomy", "observational astronomy",
                 "telescope mirror, eyepiece, light pollution, long exposure, spectrograph, "
                 "focal length, tracking mount, dark site, seeing condition, filter wheel, "
                 "aperture, photometer, observing log, camera sensor, dew shield, finder scope",
                 "align, calibrate, focus, track, image, observe, record, polish",
                 "clear, steady, portable, sensitive, refracting, reflecting, wide-field, cooled"),
        ),
    ),
    _Domain(
        "cooking", "cooking", "cooks", "cook",
        _w("kitchen, bakery, bistro, test kitchen"),
        _w("recipe, ingredient, flavor, dish, portion, seasoning, menu, utensil, pantry, aroma"),
        _w("fresh, savory, homemade, seasonal, delicious"),
        "Chef {name}",
        (
            _cat("signature_ingredient", "signature ingredient",
                 "saffron, smoked paprika, black garlic, sumac, tamarind, fennel pollen, "
                 "yuzu zest, "
                 "green cardamom, star anise, white miso, pink peppercorn, dried lime",
                 "{Ref}'s signature dish is built around {v}.",
                 "{Ref} rarely cooks without {v}."),
            _num("restaurant_capacity", "restaurant capacity", 12, 240, "seats",
                 "{Ref}'s restaurant has {v}.",
                 "The dining room run by {ref} offers {v}."),
            _num("training_years", "length of training", 3, 35, "years",
                 "{Ref} trained for {v} before opening a kitchen."),
            _cat("home_city", "home city",
                 "Lyon, Oaxaca, Osaka, Naples, Marseille, Bologna, Kyoto, Lima, Istanbul, Porto, "
                 "Seville, Hanoi, Tbilisi, Penang",
                 "{Ref} learned to cook in {v}.",
                 "{Ref} runs a kitchen in {v}."),
        ),
        (
            _sub("baking", "baking",
                 "sourdough starter, dough, oven, yeast, flour, crumb, crust, pastry, butter, "
                 "proofing basket, rolling pin, baking sheet, gluten, batter, meringue, croissant, "
                 "loaf, icing",
                 "knead, bake, proof, fold, whisk, roll, glaze, sift, cream",
                 "flaky, golden, airy, crisp, buttery, tender, risen, chewy"),
            _sub("sauces_and_stocks", "sauces and stocks",
                 "roux, stock pot, reduction, bone broth, veloute, bechamel, emulsion, pan sauce, "
                 "mirepoix, demi-glace, hollandaise, gravy, vinaigrette, bouquet garni, fond, "
                 "cream sauce",
                 "simmer, reduce, skim, strain, thicken, emulsify, season, deglaze",
                 "glossy, velvety, rich, silky, concentrated, clear, tangy, smooth"),
            _sub("grilling_and_smoking", "grilling and smoking",
                 "charcoal, smoker, brisket, wood chip, dry rub, marinade, grill grate, ember, "
                 "smoke ring, rack of ribs, open flame, barbecue sauce, meat thermometer, "
                 "fire pit, "
                 "skewer, chimney starter, bark, hickory log",
                 "grill, smoke, sear, baste, char, marinate, rest, carve",
                 "smoky, charred, juicy, slow-cooked, blackened, caramelized, fiery, succulent"),
            _sub("knife_skills", "knife skills",
                 "chef's knife, cutting board, julienne, whetstone, honing steel, shallot, "
                 "garlic clove, blade edge, paring knife, mandoline, chiffonade, herb leaf, onion, "
                 "carrot, claw grip, mise en place, bread knife",
                 "chop, mince, dice, slice, sharpen, peel, trim, hone",
                 "sharp, precise, uniform, thin, fine, rough, even, careful"),
        ),
    ),
    _Domain(
        "marine_biology", "marine biology", "marine biologists", "marine biologist",
        _w("research vessel, coastal laboratory, public aquarium, field station"),
        _w("ocean, species, habitat, seawater, current, ecosystem, tide, specimen, depth, "
           "coastline"),
        _w("marine, coastal, aquatic, oceanic, salty"),
        "the species {name}",
        (
            _num("max_depth", "maximum recorded depth", 5, 6000, "meters",
                 "{Ref} has been recorded at depths of {v}.",
                 "Submersibles have found {ref} as deep as {v}."),
            _num("adult_length", "average adult length", 2, 1800, "centimeters",
                 "Adults of {ref} grow to about {v}."),
            _num("lifespan", "typical lifespan", 2, 120, "years",
                 "{Ref} typically lives for {v}."),
            _cat("diet", "main food source",
                 "krill, plankton, sea grass, small crustaceans, algae, squid, mollusks, detritus, "
                 "jellyfish, sponges, sardines, sea urchins",
                 "{Ref} feeds mainly on {v}.",
                 "The diet of {ref} consists largely of {v}."),
        ),
        (
            _sub("coral_reefs", "coral reefs",
                 "coral polyp, reef crest, zooxanthellae, bleaching event, parrotfish, reef flat, "
                 "lagoon, atoll, calcium carbonate, sea fan, brain coral, reef slope, "
                 "spawning event, symbiotic algae, clownfish, sea anemone",
                 "bleach, colonize, spawn, shelter, calcify, graze, restore, survey",
                 "bleached, vibrant, shallow, fringing, symbiotic, fragile, colorful, tropical"),
            _sub("deep_sea_life", "deep sea life",
                 "anglerfish, hydrothermal vent, bioluminescence, abyssal plain, tube worm, "
                 "giant squid, crushing pressure, marine snow, submersible, ocean trench, "
                 "gulper eel, chemosynthesis, midnight zone, sea cucumber, vampire squid",
                 "lure, scavenge, illuminate, withstand, filter, hunt, ambush, consume",
                 "bioluminescent, abyssal, cold, lightless, gelatinous, pressurized, alien, "
                 "sparse"),
            _sub("marine_mammals", "marine mammals",
                 "humpback whale, dolphin pod, sea otter, blubber, echolocation, baleen, blowhole, "
                 "orca, seal colony, migration route, whale calf, whale song, tail fluke, "
                 "breaching display, manatee, krill swarm",
                 "tag, track, follow, nurse, protect, photograph, identify, herd",
                 "migratory, social, warm-blooded, playful, vocal, endangered, intelligent, "
                 "streamlined"),
            _sub("intertidal_zones", "intertidal zones",
                 "tide pool, barnacle, mussel bed, sea star, kelp, periwinkle, limpet, "
                 "hermit crab, "
                 "splash zone, rocky shore, wave action, sea urchin, seaweed, low tide, "
                 "high tide mark",
                 "expose, pry, shelter, graze, submerge, batter, anchor, scour",
                 "rocky, exposed, intertidal, wave-swept, sheltered, muddy, resilient, slippery"),
        ),
    ),
    _Domain(
        "music_theory", "music theory", "musicians", "musician",
        _w("conservatory, concert hall, rehearsal room, recording studio"),
        _w("melody, note, score, rhythm, instrument, performance, sound, phrase, tone, "
           "composition"),
        _w("musical, tonal, expressive, lyrical, harmonious"),
        "the composer {name}",
        (
            _num("symphonies", "number of symphonies", 2, 41, "",
                 "{Ref} wrote {v} symphonies.",
                 "In total, {ref} completed {v} symphonies."),
            _year("birth_year", "year of birth", 1600, 1950,
                  "{Ref} was born in {v}.",
                  "Biographers date the birth of {ref} to {v}."),
            _cat("instrument", "favorite instrument",
                 "cello, harpsichord, oboe, viola, organ, clarinet, lute, harp, bassoon, piano, "
                 "violin, flute",
                 "{Ref} performed in public on the {v}.",
                 "{Ref} wrote most of the early works for the {v}."),
            _cat("key", "favorite key",
                 "D minor, E-flat major, F-sharp minor, A major, C minor, B-flat major, G major, "
                 "E minor, A-flat major, B minor",
                 "{Ref} composed most often in {v}.",
                 "The best-known works of {ref} are in {v}."),
        ),
        (
            _sub("harmony_and_chords", "harmony and chords",
                 "triad, seventh chord, cadence, chord progression, dominant chord, tonic, "
                 "subdominant, voice leading, chord inversion, suspension, modulation, "
                 "diminished chord, leading tone, harmonic function, dissonance, consonance",
                 "resolve, modulate, voice, harmonize, invert, suspend, prepare, substitute",
                 "dissonant, consonant, diminished, augmented, chromatic, diatonic, unresolved, "
                 "functional"),
            _sub("rhythm_and_meter", "rhythm and meter",
                 "time signature, downbeat, syncopation, tempo, measure, beat, triplet, "
                 "polyrhythm, backbeat, upbeat, accent, meter, quarter note, rest, groove, "
                 "metronome, hemiola",
                 "accent, subdivide, count, syncopate, stress, shift, divide, keep",
                 "steady, syncopated, compound, irregular, driving, dotted, uneven, rhythmic"),
            _sub("counterpoint", "counterpoint",
                 "canon, fugue subject, countersubject, cantus firmus, imitation, inner voice, "
                 "species counterpoint, parallel fifth, contrary motion, stretto, fugal episode, "
                 "tonal answer, ground bass, passing tone, fugal exposition",
                 "imitate, invert, combine, answer, weave, develop, transpose, interlock",
                 "contrapuntal, imitative, independent, strict, florid, parallel, contrary, "
                 "polyphonic"),
            _sub("scales_and_modes", "scales and modes",
                 "major scale, minor scale, dorian mode, lydian mode, pentatonic scale, "
                 "whole tone, semitone, interval, key signature, circle of fifths, accidental, "
                 "octave, scale degree, mixolydian mode, relative minor, chromatic scale",
                 "transpose, raise, lower, spell, practice, identify, memorize, play",
                 "major, minor, modal, pentatonic, bright, dark, exotic, ascending"),
        ),
    ),
    _Domain(
        "medieval_history", "medieval history", "historians", "historian",
        _w("archive, monastery library, castle ruin, museum"),
        _w("chronicle, kingdom, century, manuscript, dynasty, charter, realm, royal court, treaty, "
           "record"),
        _w("medieval, feudal, royal, ancient, historical"),
        "King {name}",
        (
            _num("reign_length", "length of reign", 2, 58, "years",
                 "{Ref} reigned for {v}.",
                 "The chronicles say that {ref} held the throne for {v}."),
            _year("coronation_year", "year of coronation", 980, 1490,
                  "{Ref} was crowned in {v}.",
                  "The coronation of {ref} took place in {v}."),
            _cat("seat", "seat of power",
                 "Winchester, Toledo, Aachen, Palermo, Rouen, Krakow, Pavia, Uppsala, Durham, "
                 "Avignon, Trondheim, Esztergom",
                 "{Ref} ruled from {v}.",
                 "{Ref} kept a court at {v}."),
            _num("knights", "number of sworn knights", 40, 3000, "",
                 "{Ref} could call on {v} knights in time of war.",
                 "At the height of the reign, {v} knights had sworn loyalty to {ref}."),
        ),
        (
            _sub("castles_and_sieges", "castles and sieges",
                 "castle keep, curtain wall, siege engine, trebuchet, moat, drawbridge, "
                 "battlement, "
                 "garrison, gatehouse, battering ram, arrow slit, portcullis, siege tower, "
                 "rampart, motte, inner bailey",
                 "besiege, fortify, storm, defend, breach, garrison, undermine, surrender",
                 "fortified, besieged, impregnable, defensive, crenellated, starving, towering, "
                 "stone-built"),
            _sub("monasteries_and_the_church", "monasteries and the church",
                 "abbey, monk, scriptorium, abbot, illuminated manuscript, cloister, pilgrimage, "
                 "holy relic, tithe, bishop, parish, cathedral, liturgy, chapter house, "
                 "monastic vow, friar",
                 "copy, illuminate, consecrate, endow, reform, venerate, ordain, chant",
                 "monastic, pious, devout, ecclesiastical, cloistered, sacred, gilded, "
                 "contemplative"),
            _sub("feudal_society", "feudal society",
                 "lord, vassal, serf, manor, fief, oath of fealty, knight, peasant, harvest due, "
                 "manorial court, tenant, act of homage, common land, estate, reeve, villein",
                 "grant, swear, till, owe, inherit, levy, collect, serve",
                 "hereditary, agrarian, bound, landed, noble, servile, manorial, obligated"),
            _sub("crusades_and_trade", "crusades and trade",
                 "crusade, pilgrim route, merchant guild, trade fair, spice route, galley, "
                 "caravan, "
                 "silver coin, river toll, port city, banker, wool trade, letter of credit, "
                 "warehouse, merchant ledger",
                 "trade, ship, finance, export, import, tax, barter, escort",
                 "mercantile, lucrative, armed, prosperous, overland, seaborne, foreign, "
                 "far-flung"),
        ),
    ),
    _Domain(
        "football", "football", "players", "player",
        _w("stadium, training ground, clubhouse, dressing room"),
        _w("match, season, goal, team, league, fixture, referee, squad, kit, whistle"),
        _w("competitive, professional, attacking, defensive, sporting"),
        "the club {name}",
        (
            _year("founding_year", "founding year", 1857, 1995,
                  "{Ref} was founded in {v}.",
                  "Supporters of {ref} celebrate a founding date in {v}."),
            _num("stadium_capacity", "stadium capacity", 4000, 81000, "seats",
                 "The home ground of {ref} holds {v}."),
            _num("league_titles", "number of league titles", 2, 34, "",
                 "{Ref} has won {v} league titles.",
                 "Over its history, {ref} has lifted {v} league titles."),
            _cat("colors", "club colors",
                 "maroon and gold, green and white, black and amber, sky blue and navy, "
                 "red and black, claret and blue, orange and white, purple and silver, "
                 "yellow and green, navy and white",
                 "{Ref} plays in {v}.",
                 "The shirts of {ref} are {v}."),
        ),
        (
            _sub("tactics_and_formations", "tactics and formations",
                 "back four, pressing game, counterattack, midfield diamond, high line, formation, "
                 "full-back, wing play, offside trap, pressing trigger, false nine, "
                 "holding midfielder, possession, switch of play, half-space, overload",
                 "press, overload, stretch, compress, mark, exploit, shift, block",
                 "compact, aggressive, narrow, wide, fluid, rigid, direct, patient"),
            _sub("goalkeeping", "goalkeeping",
                 "goalkeeper, penalty area, crossbar, goal line, diving save, punched clearance, "
                 "distribution, six-yard box, reflex save, near post, far post, shot stopper, "
                 "goal kick, catching technique, goalkeeper glove, one-on-one",
                 "parry, catch, punch, claim, distribute, command, smother, save",
                 "agile, brave, commanding, vocal, acrobatic, reliable, quick, alert"),
            _sub("transfers_and_club_finance", "transfers and club finance",
                 "transfer fee, contract clause, release clause, football agent, loan deal, "
                 "wage bill, transfer window, youth academy, scout, sell-on clause, "
                 "signing bonus, market valuation, shirt sponsor, medical test, broadcasting deal",
                 "sign, loan, negotiate, scout, release, sell, renew, value",
                 "lucrative, expensive, long-term, promising, undervalued, record, permanent, "
                 "contractual"),
            _sub("training_and_fitness", "training and fitness",
                 "warm-up, sprint drill, rondo, recovery session, stamina, hamstring, "
                 "agility ladder, cooldown, interval run, tactical drill, small-sided game, "
                 "physio, fitness test, ice bath, pre-season camp",
                 "stretch, rehearse, drill, strengthen, rotate, condition, repeat, monitor",
                 "intense, explosive, demanding, gradual, physical, repetitive, fatigued, fit"),
        ),
    ),
    _Domain(
        "chemistry", "chemistry", "chemists", "chemist",
        _w("laboratory, fume hood, research institute, teaching lab"),
        _w("molecule, reaction, compound, element, solution, sample, chemical bond, experiment, "
           "reagent, atom"),
        _w("chemical, molecular, reactive, pure, experimental"),
        "the compound {name}",
        (
            _num("melting_point", "melting point", 12, 1900, "degrees Celsius",
                 "{Ref} melts at {v}.",
                 "Samples of {ref} turn liquid at {v}."),
            _dec("molar_mass", "molar mass", 180, 9500, "grams per mole",
                 "{Ref} has a molar mass of {v}."),
            _cat("crystal_color", "crystal color",
                 "pale yellow, deep violet, colorless, emerald green, rust orange, cobalt blue, "
                 "milky white, crimson, olive brown, pale pink",
                 "Crystals of {ref} are {v}.",
                 "When it crystallizes, {ref} forms {v} needles."),
            _num("solubility", "solubility in water", 1, 900, "grams per liter",
                 "{Ref} dissolves in water up to {v}."),
        ),
        (
            _sub("organic_chemistry", "organic chemistry",
                 "carbon chain, benzene ring, functional group, alkene, ester, alcohol, polymer, "
                 "chiral center, carbonyl group, isomer, aromatic compound, amine, ketone, "
                 "substitution reaction, double bond, hydrocarbon",
                 "synthesize, substitute, oxidize, esterify, polymerize, cleave, protect, purify",
                 "organic, aromatic, chiral, saturated, unsaturated, volatile, cyclic, branched"),
            _sub("electrochemistry", "electrochemistry",
                 "electrode, anode, cathode, electrolyte, galvanic cell, redox reaction, "
                 "salt bridge, oxidation state, battery cell, electroplating bath, half reaction, "
                 "cell voltage, corrosion, current density, metal ion",
                 "reduce, plate, charge, discharge, corrode, conduct, balance, measure",
                 "electrolytic, galvanic, conductive, oxidizing, reducing, ionic, corrosive, "
                 "rechargeable"),
            _sub("analytical_chemistry", "analytical chemistry",
                 "titration, spectrometer, chromatography column, calibration curve, burette, "
                 "detection limit, mass spectrum, standard solution, pipette, absorbance, "
                 "retention time, color indicator, sample matrix, reagent blank, "
                 "measurement precision",
                 "titrate, calibrate, quantify, dilute, separate, detect, analyze, weigh",
                 "quantitative, precise, accurate, trace, sensitive, reproducible, calibrated, "
                 "analytical"),
            _sub("thermodynamics_and_kinetics", "thermodynamics and kinetics",
                 "enthalpy, entropy, activation energy, reaction rate, catalyst, "
                 "equilibrium constant, free energy, heat capacity, rate constant, "
                 "transition state, calorimeter, exothermic reaction, molecular collision, "
                 "reaction temperature, partial pressure",
                 "catalyze, accelerate, absorb, release, shift, favor, slow, measure",
                 "exothermic, endothermic, spontaneous, reversible, kinetic, thermal, stable, "
                 "rate-limiting"),
        ),
    ),
    _Domain(
        "gardening", "gardening", "gardeners", "gardener",
        _w("greenhouse, allotment, plant nursery, walled garden"),
        _w("plant, soil, seed, garden, growing season, root, leaf, flower bed, watering can, "
           "compost"),
        _w("green, leafy, hardy, fertile, overgrown"),
        "the cultivar {name}",
        (
            _num("mature_height", "mature height", 10, 400, "centimeters",
                 "{Ref} grows to a height of {v}.",
                 "Left unpruned, {ref} reaches {v}."),
            _cat("flower_color", "flower color",
                 "apricot, deep crimson, butter yellow, lilac, ivory, coral pink, burgundy, "
                 "salmon, pure white, lavender blue, scarlet, peach",
                 "{Ref} produces {v} flowers.",
                 "The blooms of {ref} are {v}."),
            _num("days_to_maturity", "time to maturity", 40, 180, "days",
                 "{Ref} reaches maturity in {v}."),
            _cat("hardiness_zone", "hardiness zone",
                 "zone 3, zone 4, zone 5, zone 6, zone 7, zone 8, zone 9, zone 10",
                 "{Ref} is hardy down to {v}.",
                 "Growers rate {ref} for {v}."),
        ),
        (
            _sub("vegetable_growing", "vegetable growing",
                 "tomato vine, raised bed, seedling, potato crop, runner bean, crop rotation, "
                 "carrot row, brassica, squash, cloche, seed tray, onion set, pea trellis, "
                 "harvest basket, lettuce",
                 "sow, transplant, thin, harvest, water, stake, weed, rotate",
                 "ripe, tender, early, productive, crisp, homegrown, sturdy, bolting"),
            _sub("roses_and_ornamentals", "roses and ornamentals",
                 "rose bush, climbing rose, flower border, perennial, dahlia tuber, peony, hedge, "
                 "topiary, bloom, petal, lavender, clematis, rose hip, ornamental grass, "
                 "spent flower head",
                 "prune, deadhead, train, mulch, feed, divide, plant, cut",
                 "fragrant, ornamental, climbing, flowering, showy, scented, blooming, "
                 "repeat-flowering"),
            _sub("soil_and_composting", "soil and composting",
                 "compost heap, leaf mould, earthworm, loam, clay soil, mulch, manure, soil pH, "
                 "humus, nitrogen, green manure, wormery, drainage, topsoil, sharp sand",
                 "turn, enrich, aerate, dig, test, amend, spread, sieve",
                 "rich, crumbly, acidic, alkaline, sandy, heavy, moist, well-drained"),
            _sub("pests_and_diseases", "pests and diseases",
                 "aphid, slug, blight, powdery mildew, vine weevil, caterpillar, greenfly, beetle, "
                 "rust fungus, insect netting, ladybird, fungicide, companion plant, leaf spot, "
                 "root rot",
                 "spray, trap, inspect, deter, control, repel, treat, remove",
                 "infested, fungal, resistant, damaging, persistent, wilting, diseased, "
                 "pest-free"),
        ),
    ),
    _Domain(
        "aviation", "aviation", "pilots", "pilot",
        _w("airfield, hangar, control tower, flight school"),
        _w("aircraft, flight, runway, altitude, cockpit, airspeed, flight crew, wing, engine, "
           "airport"),
        _w("airborne, aeronautical, aerial, commercial, airworthy"),
        "the aircraft {name}",
        (
            _dec("wingspan", "wingspan", 80, 800, "meters",
                 "{Ref} has a wingspan of {v}.",
                 "From tip to tip, the wings of {ref} measure {v}."),
            _num("max_range", "maximum range", 400, 15000, "kilometers",
                 "{Ref} can fly up to {v} without refueling."),
            _num("passenger_capacity", "passenger capacity", 4, 520, "passengers",
                 "{Ref} carries up to {v}.",
                 "In its standard layout, {ref} seats {v}."),
            _year("first_flight", "year of first flight", 1935, 2020,
                  "{Ref} first flew in {v}.",
                  "The maiden flight of {ref} took place in {v}."),
        ),
        (
            _sub("aerodynamics", "aerodynamics",
                 "lift, drag, airfoil, angle of attack, wingtip vortex, boundary layer, stall, "
                 "wing flap, leading-edge slat, camber, thrust, laminar flow, wing loading, "
                 "downwash, pressure gradient",
                 "generate, reduce, deflect, stall, streamline, accelerate, separate, redirect",
                 "aerodynamic, laminar, turbulent, swept, high-lift, induced, subsonic, "
                 "supersonic"),
            _sub("navigation_and_air_traffic", "navigation and air traffic control",
                 "flight plan, waypoint, radar, transponder, approach chart, holding pattern, "
                 "departure clearance, airway, compass heading, VOR beacon, "
                 "instrument landing system, squawk code, radio frequency, altimeter setting, "
                 "air traffic controller",
                 "navigate, clear, vector, sequence, intercept, report, plot, radio",
                 "instrument, visual, controlled, assigned, busy, coordinated, en-route, "
                 "radar-guided"),
            _sub("aircraft_maintenance", "aircraft maintenance",
                 "inspection, airframe, turbine blade, hydraulic line, maintenance logbook, "
                 "torque wrench, rivet, landing gear, fuel pump, corrosion check, engine overhaul, "
                 "borescope, maintenance schedule, fastener, propeller",
                 "inspect, overhaul, replace, torque, lubricate, certify, repair, test",
                 "worn, certified, scheduled, faulty, routine, cracked, serviceable, grounded"),
            _sub("flight_training", "flight training",
                 "student pilot, flight instructor, solo flight, checkride, flight simulator, "
                 "touch-and-go, crosswind landing, flight hours, stall recovery, traffic pattern, "
                 "preflight check, control yoke, rudder pedal, throttle, trim wheel",
                 "practice, demonstrate, land, taxi, brief, recover, rehearse, fly",
                 "nervous, smooth, confident, gusty, supervised, solo, careful, unstable"),
        ),
    ),
    _Domain(
        "finance", "finance", "investors", "investor",
        _w("trading floor, stock exchange, bank branch, investment firm"),
        _w("market, price, investment, return, risk, capital, portfolio, asset, interest, fund"),
        _w("financial, volatile, fiscal, monetary, economic"),
        "the investment fund {name}",
        (
            _num("assets_under_management", "assets under management", 40, 90000,
                 "million dollars",
                 "{Ref} manages {v} in assets.",
                 "Clients have entrusted {v} to {ref}."),
            _dec("annual_fee", "annual fee", 1, 25, "percent",
                 "{Ref} charges an annual fee of {v}."),
            _year("launch_year", "launch year", 1950, 2021,
                  "{Ref} was launched in {v}.",
                  "{Ref} opened to investors in {v}."),
            _cat("headquarters", "headquarters",
                 "Zurich, Singapore, Frankfurt, Toronto, Chicago, Luxembourg, Edinburgh, Dublin, "
                 "Boston, Sydney, Oslo, Geneva",
                 "{Ref} is headquartered in {v}.",
                 "{Ref} runs its operations from {v}."),
        ),
        (
            _sub("stock_markets", "stock markets",
                 "share price, dividend, earnings report, index fund, bull market, bear market, "
                 "trading volume, market capitalization, initial public offering, stock split, "
                 "price-to-earnings ratio, order book, blue chip, short seller, market sector",
                 "buy, sell, trade, short, list, hedge, diversify, value",
                 "bullish, bearish, listed, overvalued, liquid, speculative, blue-chip, "
                 "dividend-paying"),
            _sub("banking_and_lending", "banking and lending",
                 "mortgage, savings account, loan officer, credit score, interest rate, "
                 "collateral, "
                 "overdraft, deposit, loan default, central bank, reserve requirement, "
                 "checking account, repayment schedule, lender, borrower",
                 "lend, borrow, deposit, repay, approve, refinance, withdraw, secure",
                 "creditworthy, secured, unsecured, fixed, variable, overdue, insured, prudent"),
            _sub("personal_budgeting", "personal budgeting",
                 "household budget, emergency fund, grocery bill, expense tracker, monthly rent, "
                 "paycheck, savings goal, credit card balance, spending plan, utility bill, "
                 "sinking fund, allowance, receipt, household debt",
                 "track, save, budget, cut, allocate, pay, spend, review",
                 "frugal, monthly, disciplined, unexpected, essential, discretionary, modest, "
                 "realistic"),
            _sub("insurance_and_risk", "insurance and risk",
                 "insurance premium, deductible, policyholder, insurance claim, underwriter, "
                 "actuary, coverage, risk pool, reinsurance, payout, exclusion clause, "
                 "life insurance, liability, loss ratio, claims adjuster",
                 "insure, underwrite, file, assess, cover, settle, price, pool",
                 "insured, actuarial, catastrophic, covered, uninsured, annual, liable, "
                 "comprehensive"),
        ),
    ),
    _Domain(
        "computer_networking", "computer networking", "network engineers", "network engineer",
        _w("data center, server room, network operations center, wiring closet"),
        _w("network, packet, protocol, router, bandwidth, latency, connection, server, traffic, "
           "IP address"),
        _w("digital, wired, wireless, networked, online"),
        "the data center {name}",
        (
            _num("rack_count", "rack count", 40, 12000, "server racks",
                 "{Ref} houses {v}."),
            _dec("power_draw", "power draw", 5, 1500, "megawatts",
                 "{Ref} draws {v} of power.",
                 "At full load, {ref} consumes {v}."),
            _cat("location", "location",
                 "Reykjavik, Helsinki, Ashburn, Amsterdam, Quebec, Stockholm, Tallinn, Phoenix, "
                 "Hyderabad, Santiago, Auckland, Nairobi",
                 "{Ref} is located near {v}.",
                 "Engineers travel to {v} to service {ref}."),
            _year("opening_year", "opening year", 1995, 2023,
                  "{Ref} went online in {v}.",
                  "{Ref} began serving traffic in {v}."),
        ),
        (
            _sub("routing_and_switching", "routing and switching",
                 "routing table, switch port, VLAN, spanning tree, BGP session, OSPF area, "
                 "next hop, subnet, default gateway, forwarding table, trunk link, "
                 "route advertisement, network prefix, autonomous system, broadcast domain",
                 "route, forward, advertise, flood, segment, aggregate, filter, tag",
                 "redundant, dynamic, static, hierarchical, converged, layered, looping, optimal"),
            _sub("network_security", "network security",
                 "firewall rule, intrusion detection system, VPN tunnel, encryption key, "
                 "certificate, access control list, port scan, phishing attempt, "
                 "zero-day exploit, security audit, authentication token, "
                 "denial-of-service attack, honeypot, security patch, threat model",
                 "encrypt, authenticate, block, scan, patch, audit, harden, intercept",
                 "secure, encrypted, malicious, vulnerable, authenticated, suspicious, hardened, "
                 "compromised"),
            _sub("wireless_networks", "wireless networks",
                 "access point, signal strength, radio channel, antenna, mesh node, "
                 "Wi-Fi standard, "
                 "interference, roaming client, frequency band, beamforming, network name, "
                 "range extender, signal-to-noise ratio, coverage map, hotspot",
                 "broadcast, extend, tune, survey, amplify, configure, scan, connect",
                 "crowded, weak, strong, omnidirectional, dual-band, mobile, congested, "
                 "line-of-sight"),
            _sub("protocols_and_transport", "protocols and transport",
                 "TCP handshake, UDP datagram, congestion window, retransmission, checksum, "
                 "port number, packet header, sequence number, acknowledgment, socket, DNS query, "
                 "HTTP request, TLS handshake, packet loss, round-trip time",
                 "acknowledge, retransmit, encapsulate, resolve, negotiate, fragment, reorder, "
                 "timestamp",
                 "reliable, connectionless, stateful, stateless, ordered, lossy, encrypted, "
                 "lightweight"),
        ),
    ),
    _Domain(
        "mythology", "mythology", "storytellers", "storyteller",
        _w("ancient temple, sacred grove, oracle shrine, village hearth"),
        _w("myth, legend, god, hero, tale, ritual, oracle, prophecy, epic, deity"),
        _w("mythical, divine, legendary, sacred, ancestral"),
        "the hero {name}",
        (
            _cat("weapon", "weapon",
                 "bronze spear, silver bow, ash staff, iron sword, golden sling, bone dagger, "
                 "oak club, obsidian blade, copper trident, flint axe",
                 "{Ref} fought with {a_v}.",
                 "{Ref} carried {a_v} into every battle.", article=True),
            _cat("homeland", "homeland",
                 "the Salt Marshes, the Amber Coast, the Iron Hills, the Whispering Vale, "
                 "the Ninefold Isles, the Red Steppe, the Cloud Peaks, the Silver Fjord, "
                 "the Ashen Plain, the Hollow Woods",
                 "{Ref} came from {v}.",
                 "The songs say that {ref} was raised in {v}."),
            _num("trials", "number of trials", 3, 40, "",
                 "{Ref} completed {v} trials before the gods relented.",
                 "The legend counts {v} trials faced by {ref}."),
            _cat("sacred_animal", "sacred animal",
                 "white stag, raven, owl, bull, serpent, falcon, wolf, boar, swan, lion, eagle, "
                 "dolphin",
                 "{Ref} was guided by {a_v}.",
                 "In every telling, {ref} is accompanied by {a_v}.", article=True),
        ),
        (
            _sub("greek_mythology", "Greek mythology",
                 "Olympian council, thunderbolt, titan, labyrinth, minotaur, golden fleece, "
                 "nymph, centaur, ambrosia, oracle at Delphi, Trojan horse, muse, underworld, "
                 "ferryman, hydra, winged sandal",
                 "defy, punish, slay, outwit, banish, bless, curse, tempt",
                 "Olympian, immortal, vengeful, heroic, tragic, cunning, wrathful, godlike"),
            _sub("norse_mythology", "Norse mythology",
                 "hall of the slain, rune stone, world tree, frost giant, valkyrie, longship, "
                 "mead hall, thunder hammer, world serpent, skald, raven messenger, "
                 "rainbow bridge, dwarf smith, twilight of the gods, one-eyed wanderer",
                 "forge, sail, guard, foretell, summon, wield, carve, feast",
                 "icy, fateful, fierce, doomed, grim, northern, ravenous, runic"),
            _sub("egyptian_mythology", "Egyptian mythology",
                 "Nile flood, sun barque, scarab, pharaoh, ankh, afterlife, Book of the Dead, "
                 "falcon god, jackal god, pyramid tomb, sarcophagus, mummy, hieroglyph, obelisk, "
                 "weighing of the heart, canopic jar",
                 "embalm, inscribe, entomb, worship, judge, guide, anoint, preserve",
                 "eternal, golden, solar, funerary, gilded, pharaonic, embalmed, desert"),
            _sub("folklore_and_fairy_tales", "folklore and fairy tales",
                 "enchanted forest, witch's cottage, talking animal, changeling, fairy ring, "
                 "magic spell, wicked stepmother, glass slipper, troll bridge, magic bean, "
                 "wishing well, woodcutter, giant, moral of the story",
                 "enchant, bewitch, trick, rescue, grant, disguise, break, outwit",
                 "enchanted, wicked, magical, cursed, humble, clever, moonlit, whimsical"),
        ),
    ),
    _Domain(
        "geology", "geology", "geologists", "geologist",
        _w("field site, quarry, core repository, rock outcrop"),
        _w("rock, mineral, rock layer, sediment, crust, formation, rock sample, fault, erosion, "
           "landscape"),
        _w("geological, rugged, tectonic, weathered, bedrock"),
        "Mount {name}",
        (
            _num("elevation", "elevation", 300, 8200, "meters",
                 "{Ref} rises to {v} above sea level.",
                 "The summit of {ref} stands {v} high."),
            _cat("rock_type", "dominant rock type",
                 "granite, basalt, limestone, gneiss, andesite, schist, sandstone, marble, "
                 "rhyolite, quartzite, slate, dolomite",
                 "{Ref} is made mostly of {v}.",
                 "Climbers on {ref} walk almost entirely on {v}."),
            _num("age", "estimated age", 2, 900, "million years",
                 "{Ref} formed roughly {v} ago."),
            _year("first_ascent", "year of first ascent", 1786, 1990,
                  "{Ref} was first climbed in {v}.",
                  "Nobody reached the top of {ref} until {v}."),
        ),
        (
            _sub("plate_tectonics", "plate tectonics",
                 "subduction zone, mid-ocean ridge, continental plate, fault line, rift valley, "
                 "earthquake, seismic wave, mantle plume, transform boundary, mountain belt, "
                 "oceanic crust, epicenter, tsunami, seismograph, plate boundary",
                 "subduct, deform, spread, uplift, fracture, rupture, push, fold",
                 "seismic, oceanic, continental, active, convergent, divergent, molten, "
                 "shifting"),
            _sub("volcanology", "volcanology",
                 "magma chamber, lava flow, caldera, pyroclastic flow, volcanic ash, crater rim, "
                 "fumarole, basalt column, eruption column, lava dome, volcanic vent, tephra, "
                 "obsidian, shield volcano, sulfur deposit",
                 "vent, deposit, monitor, bury, inflate, sample, eject, cool",
                 "volcanic, explosive, effusive, dormant, glowing, ash-laden, glassy, restless"),
            _sub("minerals_and_crystals", "minerals and crystals",
                 "quartz crystal, feldspar, mica sheet, crystal lattice, cleavage plane, "
                 "hardness scale, luster, garnet, calcite, geode, streak test, gemstone, "
                 "crystal habit, pyrite, amethyst",
                 "cleave, polish, grow, identify, scratch, facet, classify, test",
                 "crystalline, translucent, lustrous, cubic, hexagonal, brittle, metallic, "
                 "iridescent"),
            _sub("sedimentary_rocks_and_fossils", "sedimentary rocks and fossils",
                 "sandstone, limestone, shale, fossil bed, ammonite, strata, trilobite, riverbed, "
                 "river delta, conglomerate, bedding plane, fossil record, cross-bedding, "
                 "mudstone, index fossil",
                 "deposit, compact, cement, excavate, date, erode, preserve, expose",
                 "sedimentary, layered, fossilized, porous, fine-grained, coarse, stratified, "
                 "petrified"),
        ),
    ),
    _Domain(
        "fashion", "fashion", "designers", "designer",
        _w("atelier, runway show, boutique, fashion house"),
        _w("garment, collection, fabric, style, trend, outfit, clothing label, wardrobe, "
           "silhouette, accessory"),
        _w("stylish, elegant, fashionable, chic, tailored"),
        "the fashion house {name}",
        (
            _year("founding_year", "founding year", 1858, 2015,
                  "{Ref} opened its first atelier in {v}.",
                  "{Ref} was founded in {v}."),
            _num("boutiques", "number of boutiques", 3, 400, "",
                 "{Ref} runs {v} boutiques worldwide.",
                 "Shoppers can visit {v} boutiques operated by {ref}."),
            _cat("signature_fabric", "signature fabric",
                 "silk crepe, boiled wool, organza, brocade, chiffon, gabardine, mohair, "
                 "seersucker, taffeta, corduroy, tulle, jersey",
                 "{Ref} is best known for its work in {v}.",
                 "Nearly every collection from {ref} features {v}."),
            _cat("home_city", "home city",
                 "Paris, Milan, Antwerp, Tokyo, London, Florence, Copenhagen, Seoul, Barcelona, "
                 "Lagos, Melbourne, Vienna",
                 "{Ref} is based in {v}.",
                 "{Ref} shows its collections in {v}."),
        ),
        (
            _sub("tailoring", "tailoring",
                 "lapel, shoulder pad, trouser hem, waistcoat, tailor's chalk, bespoke suit, "
                 "inseam, buttonhole, canvas interlining, fitting session, dart, shirt cuff, "
                 "paper pattern, measuring tape, seam allowance",
                 "tailor, hem, stitch, baste, alter, press, measure, cut",
                 "bespoke, sharp, double-breasted, slim, structured, handmade, fitted, "
                 "single-breasted"),
            _sub("textiles_and_fabrics", "textiles and fabrics",
                 "wool tweed, silk satin, linen weave, cotton twill, loom, thread count, denim, "
                 "cashmere, velvet pile, jacquard, yarn, dye bath, knitwear, weft, warp",
                 "weave, dye, spin, knit, blend, print, felt, bleach",
                 "woven, soft, breathable, lightweight, coarse, durable, hand-dyed, lustrous"),
            _sub("runway_and_fashion_weeks", "runway and fashion weeks",
                 "runway, fashion model, backstage, front row, fashion week, catwalk, "
                 "show invitation, lookbook, stylist, collection preview, fashion editor, "
                 "photographer, casting call, finale, spotlight",
                 "present, style, showcase, cast, photograph, review, launch, preview",
                 "dramatic, avant-garde, glamorous, exclusive, theatrical, bold, minimalist, "
                 "daring"),
            _sub("streetwear_and_sneakers", "streetwear and sneakers",
                 "sneaker drop, hoodie, graphic tee, limited edition, resale market, skate shoe, "
                 "baseball cap, logo, brand collaboration, sneaker sole, bomber jacket, "
                 "cargo pants, tracksuit, sneaker collector, streetwear brand",
                 "release, collect, resell, customize, layer, restock, wear, design",
                 "limited, oversized, casual, urban, retro, hyped, comfortable, sold-out"),
        ),
    ),
    _Domain(
        "medicine", "medicine", "physicians", "physician",
        _w("hospital, clinic, emergency room, teaching hospital"),
        _w("patient, treatment, diagnosis, symptom, disease, therapy, dose, health, medication, "
           "recovery"),
        _w("clinical, medical, chronic, acute, therapeutic"),
        "Doctor {name}",
        (
            _num("operations", "surgical caseload", 100, 9000, "operations",
                 "{Ref} has performed {v}.",
                 "Over a long career, {ref} has completed {v}."),
            _num("years_of_practice", "length of practice", 2, 45, "years",
                 "{Ref} has practiced medicine for {v}."),
            _cat("hospital", "hospital",
                 "Northgate General, Riverside Infirmary, Harbor View Clinic, Elmwood Memorial, "
                 "Saint Aldric Hospital, Kingsbridge Royal, Lakeside Medical Center, "
                 "Westmoor Hospital, Ashford Teaching Hospital, Hillcrest Clinic",
                 "{Ref} works at {v}.",
                 "Patients can see {ref} at {v}."),
            _num("publications", "publication record", 3, 600, "research papers",
                 "{Ref} has written {v}.",
                 "Over the years, {ref} has published {v}."),
        ),
        (
            _sub("cardiology", "cardiology",
                 "heart valve, coronary artery, blood pressure, electrocardiogram, arrhythmia, "
                 "stent, pacemaker, heart rate, cholesterol, aorta, ventricle, angioplasty, "
                 "heart attack, arterial plaque, stethoscope",
                 "monitor, pump, implant, regulate, block, clear, stabilize, dilate",
                 "cardiac, coronary, irregular, elevated, vascular, arterial, blocked, healthy"),
            _sub("infectious_diseases", "infectious diseases",
                 "virus, bacterium, vaccine, antibiotic, infection, immune response, pathogen, "
                 "outbreak, incubation period, antibody, contagion, fever, quarantine, "
                 "disease vector, drug resistance",
                 "infect, vaccinate, transmit, isolate, prescribe, contain, culture, neutralize",
                 "infectious, contagious, viral, bacterial, resistant, immune, endemic, "
                 "asymptomatic"),
            _sub("neurology", "neurology",
                 "neuron, synapse, brain scan, spinal cord, nerve, seizure, migraine, "
                 "neurotransmitter, cerebral cortex, reflex, concussion, memory loss, MRI scan, "
                 "stroke, myelin sheath",
                 "stimulate, scan, damage, repair, map, inhibit, test, image",
                 "neural, cognitive, cerebral, spinal, neurological, sensory, degenerative, "
                 "motor"),
            _sub("surgery", "surgery",
                 "scalpel, operating theater, anesthesia, incision, suture, surgeon, "
                 "sterile field, "
                 "laparoscope, stitch, retractor, scrub nurse, recovery room, skin graft, "
                 "tourniquet, post-operative care",
                 "incise, suture, sterilize, anesthetize, graft, close, remove, clamp",
                 "surgical, sterile, invasive, minimally invasive, post-operative, elective, "
                 "delicate, laparoscopic"),
        ),
    ),
    _Domain(
        "railways", "railways", "railway engineers", "railway engineer",
        _w("station, signal box, depot, engine shed"),
        _w("train, track, locomotive, timetable, carriage, passenger, platform, railway line, "
           "freight, rail"),
        _w("mainline, scheduled, narrow-gauge, railway, suburban"),
        "the locomotive {name}",
        (
            _num("top_speed", "top speed", 60, 420, "kilometers per hour",
                 "{Ref} can reach {v}.",
                 "On a clear line, {ref} runs at up to {v}."),
            _year("build_year", "year of construction", 1829, 2020,
                  "{Ref} was built in {v}.",
                  "{Ref} left the works in {v}."),
            _num("weight", "weight", 20, 250, "tonnes",
                 "{Ref} weighs {v}."),
            _cat("livery", "livery",
                 "Brunswick green, maroon, midnight blue, crimson lake, apple green, "
                 "chocolate and cream, teal, signal red, black, royal blue, mustard yellow, "
                 "silver grey",
                 "{Ref} is painted in {v}.",
                 "Enthusiasts recognize {ref} by its {v} paintwork."),
        ),
        (
            _sub("steam_locomotives", "steam locomotives",
                 "boiler, firebox, tender, coal, driving wheel, piston, smokebox, safety valve, "
                 "fireman, steam pressure, regulator, chimney, water tank, connecting rod, "
                 "steam whistle",
                 "stoke, fire, restore, raise, vent, haul, polish, drive",
                 "steam-powered, hissing, coal-fired, vintage, restored, powerful, sooty, "
                 "heritage"),
            _sub("high_speed_rail", "high-speed rail",
                 "bullet train, overhead line, pantograph, dedicated track, tilting train, maglev, "
                 "aerodynamic nose, tunnel, viaduct, traction motor, signaling system, "
                 "cab signaling, regenerative braking, top speed, electrification",
                 "electrify, brake, tilt, power, connect, link, accelerate, streamline",
                 "high-speed, electric, sleek, quiet, efficient, modern, elevated, "
                 "long-distance"),
            _sub("signaling_and_operations", "signaling and operations",
                 "semaphore signal, interlocking, block section, track circuit, points, "
                 "signal box, dispatcher, route setting, level crossing, train control, "
                 "timetable path, junction, single-line token, lever frame, axle counter",
                 "signal, dispatch, switch, interlock, route, hold, schedule, clear",
                 "interlocked, automatic, manual, safe, occupied, fail-safe, delayed, "
                 "single-track"),
            _sub("railway_construction", "railway construction",
                 "ballast, sleeper, rail joint, embankment, cutting, track gauge, surveyor, "
                 "bridge girder, earthwork, tunnel bore, welded rail, formation level, "
                 "drainage ditch, track bed, gradient",
                 "lay, survey, ballast, excavate, grade, weld, tamp, bridge",
                 "level, steep, welded, gentle, heavy, narrow, broad, raised"),
        ),
    ),
)

# fmt: on

DOMAINS: dict[str, tuple[str, ...]] = {d.key: tuple(s.key for s in d.subs) for d in _SPEC}
"""Domain key → its subtopic keys, in canonical order (16 domains × 4 subtopics). Read-only."""

TOPICS: tuple[tuple[str, str], ...] = tuple((d, t) for d, ts in DOMAINS.items() for t in ts)
"""All (domain, topic) pairs in canonical order; a topic's index here is its `topic_index`."""


# --------------------------------------------------------------------------------------------
# Morphology helpers (verbs are stored in base form; articles are chosen by sound)
# --------------------------------------------------------------------------------------------

_VOWELS = "aeiou"
# Multi-syllable verbs stressed on the last syllable double their final consonant.
_DOUBLE_FINAL = frozenset(
    _w(
        "expel, control, outwit, patrol, compel, propel, deter, repel, refer, transfer, equip, "
        "regret, submit, admit, permit, commit, transmit, retransmit, occur, rebel, acquit"
    )
)


def _third_person(v: str) -> str:
    if v.endswith(("s", "sh", "ch", "x", "z")):
        return v + "es"
    if v.endswith("y") and len(v) > 1 and v[-2] not in _VOWELS:
        return v[:-1] + "ies"
    return v + "s"


def _syllables(v: str) -> int:
    groups, prev = 0, False
    for i, c in enumerate(v):
        vow = c in _VOWELS or (c == "y" and i > 0 and v[i - 1] not in _VOWELS)
        if vow and not prev:
            groups += 1
        prev = vow
    return groups


def _gerund(v: str) -> str:
    if v.endswith("ie"):
        return v[:-2] + "ying"
    if v.endswith(("ee", "ye", "oe")):
        return v + "ing"
    if v.endswith("e") and len(v) > 2:
        return v[:-1] + "ing"
    cvc = len(v) >= 3 and v[-1] not in _VOWELS + "wxy" and v[-2] in _VOWELS and v[-3] not in _VOWELS
    if v in _DOUBLE_FINAL or (cvc and _syllables(v) == 1):
        return v + v[-1] + "ing"
    return v + "ing"


_AN_LETTER_NAMES = frozenset("AEFHILMNORSX")  # initialisms whose first letter sounds like a vowel
# Vowel-initial spellings pronounced with a consonant ("a uniform", "a one-eyed").
_A_PREFIXES = ("unif", "union", "uniq", "unit", "univ", "use", "usu", "uti", "ura", "eu", "one")


def _article(phrase: str) -> str:
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
    return "an" if lw[0] in _VOWELS else "a"


def _a(phrase: str) -> str:
    return f"{_article(phrase)} {phrase}"


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


# --------------------------------------------------------------------------------------------
# Sentence templates
# --------------------------------------------------------------------------------------------
# Fields: N1..N3 subtopic nouns (distinct; a small share from the domain's general nouns),
# V1/V2 base verbs, S1 third-person verb, G1 gerund, A1/A2 adjectives, aA1/aA2 adjective with
# its article, P practitioners, p practitioner, ap "a/an practitioner", L a place, G a general
# noun, D the domain, T the topic.

_FILLER = (
    "The {A1} {N1} is central to the study of {T}.",
    "{P} often {V1} the {N1} before they {V2} the {N2}.",
    "When {P} {V1} the {N1}, the {N2} tends to become more {A1}.",
    "{ap} who wants to {V1} the {N1} should first understand the {N2}.",
    "Why does the {N1} seem so {A1} to most {P}?",
    "Few subjects in {D} are as {A1} as the {N1}.",
    "The {N1} and the {N2} are closely linked, since both depend on the {A1} {N3}.",
    "In {T}, the {N1} usually {S1} the {N2}.",
    "Careful {P} {V1} the {N1} only after checking the {A1} {N2}.",
    "It is the {A1} {N1}, not the {N2}, that {S1} the {N3}.",
    "Without the {N1}, no {p} could {V1} the {N2} properly.",
    "Consider the {N1}: it {S1} the {N2} and shapes the {A1} {N3}.",
    "To {V1} the {N1}, {P} rely on the {N2} and on the {A1} {G}.",
    "Most introductions to {T} begin with the {N1}.",
    "At the {L}, much depends on how well the {N1} {S1} the {N2}.",
    "Although the {N1} is {A1}, experienced {P} still {V1} it regularly.",
    "{G1} the {N1} requires patience and {aA1} {N2}.",
    "By {G1} the {N1}, {ap} can learn a great deal about the {A1} {N2}.",
    "How should {P} {V1} the {N1} when the {N2} is {A1}?",
    "The {N1}, the {N2} and the {N3} together define much of {T}.",
    "If the {N1} {S1} the {N2}, the result is {aA1} {N3}.",
    "Questions about the {A1} {N1} come up in almost every discussion of {D}.",
    "Many {P} at the {L} prefer to {V1} the {N1} rather than the {N2}.",
    "One {A1} detail is often overlooked: the {N1} rarely {S1} the {N2} on its own.",
    "Beginners in {T} should learn to {V1} the {N1} before they try to {V2} the {N2}.",
    "There is a long tradition of {P} who {V1} the {N1} with great care.",
    "The most {A1} part of {T} is arguably the {N1}.",
    "Whether the {N1} turns out {A1} or {A2} depends largely on the {N2}.",
    "Let us look more closely at the {N1} and the way it {S1} the {N2}.",
    "Textbooks on {D} describe the {N1} as {A1} and the {N2} as {A2}.",
    "No serious account of {T} can ignore the {A1} {N1}.",
    "The {p} paused to {V1} the {N1}, then turned to the {N2}.",
    "Every {G} says something {A1} about the {N1}.",
    "{aA1} {N1} is easier to {V1} than {aA2} {N2}.",
    "Ask any {p} about the {N1} and you will hear about the {A1} {N2}.",
    "Over time, the {N1} {S1} the {N2}, and the {N3} grows more {A1}.",
    "Is the {N1} really more {A1} than the {N2}?",
    "Only after the {N1} {S1} the {N2} can {P} {V1} the {N3}.",
    "Notice how the {A1} {N1} and the {A2} {N2} work together.",
    "Experts in {T} still disagree about how the {N1} {S1} the {N2}.",
    "{G1} the {A1} {N1} is a skill that every {p} eventually needs.",
    "In practice, the {N1} matters more than the {A1} {N2} suggests.",
)
_OPENERS = (
    "This article looks at {T}, {aA1} corner of {D}.",
    "The study of {T} is one of the most {A1} subjects in {D}.",
    "Anyone interested in {D} eventually runs into {T}.",
    "The following notes on {T} were written for {P} and curious readers alike.",
    "What follows is a short introduction to {T} and the {A1} {N1}.",
    "Among the branches of {D}, the study of {T} stands out for the {A1} {N1}.",
)
_CLOSERS = (
    "In short, {T} rewards anyone willing to study the {N1} closely.",
    "These ideas about the {N1} and the {N2} remain at the heart of {T}.",
    "There is always more to learn about the {A1} {N1}.",
    "For {P}, the {N1} will remain {aA1} subject for years to come.",
)

# Fact phrasings that work for any attribute ({dv}: the value, with its article if it has one).
_GENERIC_FACT = (
    "The {label} of {ref} is {dv}.",
    "{Ref}'s {label} is {dv}.",
    "According to the records, the {label} of {ref} is {dv}.",
    "For {ref}, the {label} is {dv}.",
    "Any {p} familiar with {ref} knows that the {label} is {dv}.",
    "One detail stands out about {ref}: the {label} is {dv}.",
    "It is well documented that {ref}'s {label} is {dv}.",
    "Records give {dv} as the {label} of {ref}.",
)
# Extra phrasings for measured quantities that carry a unit ("... a mass of 3.2 solar masses").
_MEASURE_FACT = (
    "{Ref} is listed with {a_label} of {dv}.",
    "With {a_label} of {dv}, {ref} stands out in the records.",
)


def _fields(template: str) -> tuple[str, ...]:
    return tuple(f for _, f, _, _ in string.Formatter().parse(template) if f)


_FILLER_F = tuple((t, _fields(t)) for t in _FILLER)
_OPENERS_F = tuple((t, _fields(t)) for t in _OPENERS)
_CLOSERS_F = tuple((t, _fields(t)) for t in _CLOSERS)


# --------------------------------------------------------------------------------------------
# World: topics with conjugated vocabularies, entities and their facts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Topic:
    index: int
    domain: _Domain
    sub: _Sub
    verbs: tuple[tuple[str, str, str], ...]  # (base, third person, gerund)


@dataclass(frozen=True)
class _Fact:
    attr: _Attr
    value: str


@dataclass(frozen=True)
class _Entity:
    name: str
    ref: str
    topic_index: int
    rank: int  # 1-based Zipf rank within its subtopic
    facts: tuple[_Fact, ...]


@dataclass(frozen=True)
class _World:
    topics: tuple[_Topic, ...]
    entities: tuple[tuple[_Entity, ...], ...]  # per topic, ordered by rank
    mention_prob: tuple[float, ...]  # per rank (0-based)


_TOPIC_TABLE: tuple[_Topic, ...] = tuple(
    _Topic(
        i,
        d,
        s,
        tuple((v, _third_person(v), _gerund(v)) for v in s.verbs),
    )
    for i, (d, s) in enumerate((d, s) for d in _SPEC for s in d.subs)
)


def _vocabulary_tokens() -> frozenset[str]:
    """Every lowercase word the generator can emit besides names: names must avoid them."""
    texts: list[str] = list(_FILLER + _OPENERS + _CLOSERS + _GENERIC_FACT + _MEASURE_FACT)
    for d in _SPEC:
        texts += [d.label, d.agents, d.agent, d.ref, *d.places, *d.nouns, *d.adjs]
        for a in d.attrs:
            texts += [a.label, a.unit, *a.phrasings, *a.choices]
        for s in d.subs:
            texts += [s.label, *s.nouns, *s.verbs, *s.adjs]
    out: set[str] = set()
    for t in texts:
        word = []
        for c in t.lower() + " ":
            if c.isalpha():
                word.append(c)
            elif word:
                out.add("".join(word))
                word = []
    return frozenset(out)


_VOCAB_TOKENS = _vocabulary_tokens()

_ONSETS = _w(
    "Vel, Or, Ka, Thal, Mor, Ser, Bri, Quen, Dra, Ly, Ash, Cor, Fen, Gal, Hal, Ist, Jor, Kel, "
    "Lun, Mar, Nim, Os, Pel, Riv, Sol, Tor, Ul, Var, Wen, Yr, Zan, Bel, Cas, Del, El, Fal, Gor, "
    "Hes, Ith, Kor, Nal, Per, Sev, Tam, Ves, Ard"
)
_MIDS = _w("a, e, i, o, u, ar, en, il, or, an, eth, is, um, ad, el, ir, on, av, ith, ul, ev, os")
_ENDS = _w(
    "ion, und, ath, is, or, an, el, ia, on, ar, eth, yn, ius, ara, os, ix, em, orn, ald, ira, "
    "un, as, ek, iel, ost, imar, wen, oth, esk, ande"
)


def _make_name(rng: random.Random) -> str:
    r = rng.random()
    n_mid = 0 if r < 0.2 else (1 if r < 0.8 else 2)
    parts = [rng.choice(_ONSETS)] + [rng.choice(_MIDS) for _ in range(n_mid)] + [rng.choice(_ENDS)]
    return "".join(parts)


_AWKWARD = ("aa", "ee", "ii", "oo", "uu", "yi", "iy")


def _good_name(name: str) -> bool:
    """Pronounceable (no doubled or tripled vowels) and never a word the text uses elsewhere."""
    low = name.lower()
    if any(x in low for x in _AWKWARD):
        return False
    run = 0
    for c in low:
        run = run + 1 if c in _VOWELS + "y" else 0
        if run >= 3:
            return False
    return low not in _VOCAB_TOKENS


def _rng(seed: int, stream: int, index: int) -> random.Random:
    """An independent generator per (seed, stream, index): integer seeding is platform-stable."""
    return random.Random(((seed * 16 + stream) << 40) + index)


_S_WORLD, _S_TOPIC_ORDER, _S_PLAN, _S_TEXT, _S_LONG = 1, 2, 3, 4, 5


def _format_value(attr: _Attr, rng: random.Random) -> str:
    if attr.kind == "cat":
        return rng.choice(attr.choices)
    n = rng.randint(attr.lo, attr.hi)
    if attr.kind == "year":
        return str(n)
    text = f"{n / 10:,.1f}" if attr.kind == "dec" else f"{n:,}"
    return f"{text} {attr.unit}" if attr.unit else text


def _build_world(spec: CorpusSpec) -> _World:
    used: set[str] = set()
    per_topic: list[tuple[_Entity, ...]] = []
    for topic in _TOPIC_TABLE:
        rng = _rng(spec.seed, _S_WORLD, topic.index)
        ents = []
        for k in range(spec.entities_per_subtopic):
            while True:
                name = _make_name(rng)
                if name not in used and _good_name(name):
                    break
            used.add(name)
            attrs = topic.domain.attrs
            n_facts = rng.choice((2, 3)) if len(attrs) > 2 else len(attrs)
            chosen = sorted(rng.sample(range(len(attrs)), n_facts))
            facts = tuple(_Fact(attrs[j], _format_value(attrs[j], rng)) for j in chosen)
            ref = topic.domain.ref.format(name=name)
            ents.append(_Entity(name, ref, topic.index, k + 1, facts))
        per_topic.append(tuple(ents))
    s = float(spec.zipf_exponent)
    probs = tuple(HEAD_MENTION_PROB * (r**-s) for r in range(1, spec.entities_per_subtopic + 1))
    return _World(_TOPIC_TABLE, tuple(per_topic), probs)


# --------------------------------------------------------------------------------------------
# Document plans (what a document is about and which facts it states) and rendering
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    index: int
    topic_index: int
    target_words: int
    long: bool
    mentions: tuple[tuple[int, tuple[int, ...]], ...]  # (entity rank-1, indices of facts stated)


def _plans(spec: CorpusSpec, world: _World) -> Iterator[_Plan]:
    """The plan of every document, in order. Cheap: `entity_facts` counts mentions from it."""
    n_topics = len(world.topics)
    n_long = round(spec.long_doc_fraction * spec.n_docs)
    long_ids = set(_rng(spec.seed, _S_LONG, 0).sample(range(spec.n_docs), n_long))
    order_rng = _rng(spec.seed, _S_TOPIC_ORDER, 0)
    order: list[int] = []
    lo, hi = math.log(SHORT_DOC_WORDS[0]), math.log(SHORT_DOC_WORDS[1])
    for i in range(spec.n_docs):
        if i % n_topics == 0:  # deal topics in shuffled rounds: balanced to ±1
            order = list(range(n_topics))
            order_rng.shuffle(order)
        topic_index = order[i % n_topics]
        rng = _rng(spec.seed, _S_PLAN, i)
        is_long = i in long_ids
        if is_long:
            target = rng.randint(*LONG_DOC_WORDS)
        else:
            target = int(math.exp(rng.uniform(lo, hi)))
        mentions = []
        for k, ent in enumerate(world.entities[topic_index]):
            if rng.random() < world.mention_prob[k]:
                stated = [j for j in range(len(ent.facts)) if rng.random() < FACT_STATE_PROB]
                if not stated:
                    stated = [rng.randrange(len(ent.facts))]
                mentions.append((k, tuple(stated)))
        yield _Plan(i, topic_index, target, is_long, tuple(mentions))


def _fill(rng: random.Random, template: str, fields: tuple[str, ...], topic: _Topic) -> str:
    """Fill a template; redraw if an adjective stutters into its noun ("ornamental ornamental")."""
    for _ in range(8):
        s = _fill_once(rng, template, fields, topic)
        if not _STUTTER.search(s):
            return s
    return s


_STUTTER = re.compile(r"\b(\w+) \1\b", re.IGNORECASE)


def _fill_once(rng: random.Random, template: str, fields: tuple[str, ...], topic: _Topic) -> str:
    dom, sub = topic.domain, topic.sub
    vals: dict[str, str] = {}
    nouns: list[str] = []
    adjs: list[str] = []
    for f in fields:
        if f in vals:
            continue
        if f[0] == "N":
            while True:
                pool = dom.nouns if rng.random() < GENERAL_NOUN_SHARE else sub.nouns
                w = rng.choice(pool)
                if w not in nouns:
                    break
            nouns.append(w)
            vals[f] = w
        elif f in ("A1", "A2", "aA1", "aA2"):
            while True:
                pool = dom.adjs if rng.random() < GENERAL_ADJ_SHARE else sub.adjs
                w = rng.choice(pool)
                if w not in adjs:
                    break
            adjs.append(w)
            vals[f] = _a(w) if f[0] == "a" else w
        elif f in ("V1", "V2"):
            vals[f] = rng.choice(topic.verbs)[0]
        elif f == "S1":
            vals[f] = rng.choice(topic.verbs)[1]
        elif f == "G1":
            vals[f] = rng.choice(topic.verbs)[2]
        elif f == "P":
            vals[f] = dom.agents
        elif f == "p":
            vals[f] = dom.agent
        elif f == "ap":
            vals[f] = _a(dom.agent)
        elif f == "L":
            vals[f] = rng.choice(dom.places)
        elif f == "G":
            vals[f] = rng.choice(dom.nouns)
        elif f == "D":
            vals[f] = dom.label
        elif f == "T":
            vals[f] = sub.label
        else:  # pragma: no cover - a template typo
            raise KeyError(f"unknown template field {f!r}")
    return _cap(template.format(**vals))


def _fact_sentence(rng: random.Random, ent: _Entity, fact: _Fact, topic: _Topic) -> str:
    attr = fact.attr
    shown = _a(fact.value) if attr.article else fact.value
    options = list(attr.phrasings)
    if attr.generic:
        options += _GENERIC_FACT
        if attr.kind in ("int", "dec") and attr.unit:
            options += _MEASURE_FACT
    # Favour the attribute's own natural phrasings; the generic ones add variety.
    template = rng.choice(attr.phrasings) if rng.random() < 0.45 else rng.choice(options)
    return _cap(
        template.format(
            ref=ent.ref,
            Ref=_cap(ent.ref),
            v=fact.value,
            a_v=shown,
            dv=shown,
            label=attr.label,
            a_label=_a(attr.label),
            p=topic.domain.agent,
        )
    )


def _render(plan: _Plan, world: _World, seed: int) -> str:
    rng = _rng(seed, _S_TEXT, plan.index)
    topic = world.topics[plan.topic_index]
    ents = world.entities[plan.topic_index]
    groups = [
        [_fact_sentence(rng, ents[k], ents[k].facts[j], topic) for j in stated]
        for k, stated in plan.mentions
    ]
    words = sum(len(s.split()) for g in groups for s in g)
    t, f = rng.choice(_OPENERS_F)
    sentences = [_fill(rng, t, f, topic)]
    words += len(sentences[0].split())
    while words < plan.target_words:
        t, f = rng.choice(_FILLER_F)
        s = _fill(rng, t, f, topic)
        sentences.append(s)
        words += len(s.split())
    if rng.random() < 0.5:
        t, f = rng.choice(_CLOSERS_F)
        closer: str | None = _fill(rng, t, f, topic)
    else:
        closer = None
    paragraphs: list[list[str]] = []
    lo, hi = (4, 8) if plan.long else (3, 7)
    pos = 0
    while pos < len(sentences):
        size = rng.randint(lo, hi)
        paragraphs.append(sentences[pos : pos + size])
        pos += size
    for g in groups:  # each mention's facts stay together, somewhere after the opener
        p = rng.randrange(len(paragraphs))
        para = paragraphs[p]
        at = rng.randint(1 if p == 0 else 0, len(para))
        para[at:at] = g
    if closer is not None:
        paragraphs[-1].append(closer)
    return "\n\n".join(" ".join(p) for p in paragraphs)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def generate_corpus(spec: CorpusSpec | None = None) -> Iterator[dict]:
    """Yield the corpus records ``{"id", "text", "domain", "topic"}`` in a fixed order.

    Deterministic by construction (integer-seeded `random.Random` streams per document, no
    hashing of strings, no set iteration), so the same spec gives byte-identical records on
    any machine; documents are produced lazily, so memory stays flat for large `n_docs`.
    """
    spec = spec if spec is not None else CorpusSpec()
    world = _build_world(spec)
    for plan in _plans(spec, world):
        topic = world.topics[plan.topic_index]
        yield {
            "id": f"syn-{plan.index:06d}",
            "text": _render(plan, world, spec.seed),
            "domain": topic.domain.key,
            "topic": topic.sub.key,
        }


def entity_facts(spec: CorpusSpec | None = None) -> list[dict]:
    """Every fictional entity's facts, with how many documents of `spec`'s corpus state each.

    One dict per (entity, attribute): ``entity`` (the name), ``domain``, ``topic``,
    ``attribute`` (a key such as ``surface_temperature``), ``value`` (exactly as written in the
    text), ``mentions`` (documents stating that fact), plus ``label`` (the attribute in words),
    ``reference`` (how the text names the entity, e.g. "the star Veltharion") and ``rank`` (its
    Zipf rank within its subtopic). A knowledge benchmark uses it to ask questions whose answers
    the model saw a known number of times; facts with ``mentions == 0`` were never stated.
    Computed from the document plans only, so it costs a fraction of generating the text.
    """
    spec = spec if spec is not None else CorpusSpec()
    world = _build_world(spec)
    counts = [[[0] * len(e.facts) for e in ents] for ents in world.entities]
    for plan in _plans(spec, world):
        tc = counts[plan.topic_index]
        for k, stated in plan.mentions:
            for j in stated:
                tc[k][j] += 1
    out = []
    for topic, ents, tc in zip(world.topics, world.entities, counts):
        for ent, fc in zip(ents, tc):
            for fact, n in zip(ent.facts, fc):
                out.append(
                    {
                        "entity": ent.name,
                        "domain": topic.domain.key,
                        "topic": topic.sub.key,
                        "attribute": fact.attr.key,
                        "value": fact.value,
                        "mentions": n,
                        "label": fact.attr.label,
                        "reference": ent.ref,
                        "rank": ent.rank,
                    }
                )
    return out


def write_facts_jsonl(path: str | os.PathLike[str], spec: CorpusSpec | None = None) -> int:
    """Write `entity_facts(spec)` as JSONL (atomically) and return the fact count."""
    from memtree.io import atomic_write_text

    facts = entity_facts(spec)
    atomic_write_text(path, "".join(json.dumps(f, sort_keys=True) + "\n" for f in facts))
    return len(facts)


def write_corpus_jsonl(path: str | os.PathLike[str], spec: CorpusSpec | None = None) -> int:
    """Write the corpus as JSONL (one UTF-8 object per line) and return the record count.

    Atomic: the records go to a temporary file in the target directory, which is fsynced and
    then renamed over `path`, so a reader (or a crash) never sees a half-written corpus.
    """
    spec = spec if spec is not None else CorpusSpec()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    n = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            for record in generate_corpus(spec):
                fh.write(json.dumps(record, ensure_ascii=False))
                fh.write("\n")
                n += 1
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable (POSIX); best effort elsewhere
        dfd = os.open(target.parent, os.O_RDONLY)
    except OSError:
        return n
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)
    return n
