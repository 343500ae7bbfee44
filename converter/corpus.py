"""The text the tiny tokenizer is trained on (`data/corpus.txt`), built deterministically.

Original prose from templates and word lists, some hand-written paragraphs, code in a few
languages, CJK and emoji lines, and chat-style turns, so that the byte-level BPE learns merges
for all of them. `python -m volundr.converter corpus` rewrites data/corpus.txt from this module;
a test checks that the shipped file equals `build_corpus()`.
"""

from __future__ import annotations

import random

PARAGRAPHS = [
    "The workshop stood at the edge of the village, where the road bent toward the river. "
    "Every morning the smith lit the forge before the birds were awake, and by the time the "
    "baker opened his shutters the first horseshoes were cooling in a bucket of black water.",
    "A good tool is one you forget while you use it. The handle fits the hand, the edge stays "
    "sharp, and the weight sits where the work needs it. Only when something breaks do you "
    "notice how much thought went into the shape.",
    "When the winter storms came, the ferry stopped running and the island became a small "
    "country of its own. People traded bread for firewood, stories for tea, and the children "
    "learned to read the sky better than any almanac.",
    "Inference servers batch requests so that the accelerator stays busy. Each step, the "
    "scheduler decides which sequences run, how many prompt tokens to prefill, and which "
    "finished requests free their memory for the ones still waiting in the queue.",
    "A recurrent state summarises everything a layer has seen so far in a fixed amount of "
    "memory. Attention, by contrast, keeps every key and value, which is exact but grows with "
    "the length of the conversation. Hybrid models mix both kinds of layers.",
    "She wrote the numbers in the margin: three hundred and twelve, then forty-seven, then a "
    "question mark. The ledger did not balance, and it had not balanced for six weeks.",
    "Hash tables trade memory for speed. A key is mixed into a number, the number picks a row, "
    "and the row holds whatever was stored there. Collisions are rare when the table is large "
    "and the hash spreads its inputs evenly.",
    "The lighthouse keeper kept a diary of ships: their names, their flags, the hour they "
    "passed, and the colour of the sea. After forty years the diary filled a shelf, and "
    "nobody but him had ever read a page of it.",
    "To test a program well, you must imagine the ways it could fail: the empty list, the "
    "enormous file, the user who presses the button twice, the network that disappears in the "
    "middle of a sentence. Each of these deserves its own small, honest test.",
    "Tokenizers split text into pieces that a model can count. Frequent words become single "
    "tokens, rare words fall apart into fragments, and any byte at all can still be written, "
    "so no input is ever impossible to encode.",
]

SUBJECTS = [
    "the engineer", "a young farmer", "the old captain", "my neighbour", "the committee",
    "a curious student", "the librarian", "our team", "the robot", "a travelling musician",
    "the doctor", "the city council", "a quiet child", "the pilot", "the gardener",
    "the server", "the compiler", "the scheduler", "a small company", "the orchestra",
]
VERBS = [
    "repaired", "studied", "painted", "measured", "described", "carried", "discovered",
    "built", "tested", "explained", "rewrote", "borrowed", "delivered", "questioned",
    "compared", "translated", "optimised", "planted", "cleaned", "remembered",
]
OBJECTS = [
    "the broken bridge", "a map of the coast", "the winter garden", "an unusual machine",
    "the long report", "a box of letters", "the evening train", "a new recipe",
    "the stone wall", "every failing test", "the kernel launch", "a memory leak",
    "the attention cache", "a sorted list", "the weather station", "an old violin",
    "the quarterly budget", "a wooden boat", "the museum catalogue", "the tiny model",
]
PLACES = [
    "in the morning", "after the rain", "near the harbour", "before lunch", "at midnight",
    "in the north wing", "during the festival", "on a Tuesday", "under the bridge",
    "beside the lake", "in a hurry", "without a word", "with great care", "for the first time",
]
REASONS = [
    "because nobody else would", "so that the others could rest", "although it was late",
    "while the kettle boiled", "since the deadline was close", "as the instructions said",
    "even though the light was poor", "until everything made sense",
]
ADJECTIVES = [
    "bright", "patient", "heavy", "narrow", "ancient", "efficient", "fragile", "careful",
    "noisy", "silent", "generous", "strange", "reliable", "crooked", "golden", "rapid",
]
NOUNS = [
    "river", "engine", "garden", "lantern", "window", "market", "question", "answer",
    "signal", "harvest", "ladder", "mountain", "thread", "kitchen", "library", "token",
]

CJK = [
    "今天天气很好", "我们去公园散步吧", "这个模型可以在一张显卡上运行", "请把文件保存到桌面上",
    "他每天早上六点起床", "然后去跑步", "学习新的语言需要耐心和时间", "服务器正在处理你的请求",
    "请稍等", "春眠不觉晓", "处处闻啼鸟", "大模型的推理需要很多显存", "我喜欢喝茶",
    "东京の夏はとても暑いです", "この本はとても面白かったです", "明日は雨が降るかもしれません",
    "コンピューターの電源を入れてください", "ありがとうございます",
    "오늘은 날씨가 정말 좋네요", "이 프로그램은 빠르게 실행됩니다", "감사합니다",
]
CJK_PUNCT = ["，", "。", "！", "？", "、", " "]
EMOJI = [
    "Great job! 🎉🎉", "I love this 😍", "Coffee time ☕️", "Ship it 🚀", "Oops 🙈",
    "Rainy day 🌧️ at home 🏠", "Thanks a lot 🙏", "Pizza 🍕 or sushi 🍣?", "Done ✅",
    "Warning ⚠️ low memory", "Good night 🌙✨", "Family 👨‍👩‍👧‍👦 dinner",
]

# A broad vocabulary so that BPE finds a few thousand merges in a small corpus.
WORDS = """
able about above accept across action active actual address admit adult advice afford afraid
after again against agency agent agree ahead allow almost alone along already also although
always amount analysis animal announce another answer anyone anything appear apply approach
area argue around arrive article artist assume attack attempt attend attention author avoid
away baby back balance base beautiful because become before begin behaviour behind believe
benefit best better between beyond billion black blood board body book border both bottle
bread break bring brother budget build business button buyer cable camera campaign capital
career carry case catch cause centre century certain chair challenge chance change chapter
charge cheap check choice choose church circle citizen claim class clear climate close coach
coast collect college colour column combine comfort common community compare complete
concern condition conference consider contain content context continue control corner cost
could country couple course court cover create credit crime culture current customer cycle
danger daughter debate decade decide deep defence degree demand depend describe design detail
develop device difference difficult dinner direction discover discuss disease distance doctor
document double dream drive early earth economy edge education effect effort either election
element employee energy enjoy enough enter entire environment equal error escape especially
evening event evidence exactly example exchange exercise exist expect experience expert explain
factor family famous father feature federal feeling field figure final finger finish fire
floor flower focus follow force foreign forest forget formal forward freedom friend future
garden general generation gentle glass global government great green ground group growth guess
guide habit half hand happen happy hardware health heart heavy height history holiday home
hospital hotel house however huge human hundred husband idea image imagine impact important
improve include increase indeed industry information inside instead interest interview
island issue item journey judge justice keep kitchen knowledge language large later laugh
lawyer leader learn least leave letter level library light likely limit listen little local
machine magazine maintain major manage manager market material matter maybe meaning measure
media medical meeting member memory mention message method middle might military million mind
minute mirror mission model modern moment money month morning mother motion mountain movement
music nation natural nature nearly necessary network never news night nothing notice number
object obvious ocean offer office often opinion option order organisation original other
outside owner page painting paper parent particular partner party pattern peace people
perform perhaps period person picture piece place plan plant player pocket point police policy
popular position positive possible power practice prepare present pressure pretty prevent
price private probably problem process produce product program project promise property
protect prove provide public purpose quality quarter question quickly quite radio range rather
reach reader ready reality reason receive recent recognise record reduce reflect region relate
release remain remove report represent require research resource respond result return reveal
river road rock room round rule safety salt sample save scene school science season second
secret section security seem sell send sense series serious service settle several shadow
shape share shoulder signal silver similar simple single sister situation skill small smile
social society soldier someone sometimes sound source south space speak special speech spend
spring square staff stage standard start state station stay step still stock stone store
story strategy street strong structure student study style subject success sudden suffer
suggest summer support surface system table talent teacher technology television tell theory
thing think thousand threat through throughout ticket today together tomorrow tonight total
toward town trade tradition traffic training travel treatment trial trouble truth turn type
under understand unit until upon usually valley various village violence visit voice volume
wait walk wall watch water wealth weapon wear week weight whatever wheel whether while white
whole widow window winter within without woman wonder wood word worker world worry writer
yard yellow young yourself
""".split()
SUFFIXES = ["", "", "", "s", "ing", "ed", "ly", "ness", "er", "ful", "less", "ment", "ish"]
SYLLABLES = ["ka", "lo", "ri", "men", "dor", "val", "ith", "an", "bel", "tor", "su", "mi",
             "gar", "eth", "wyn", "os", "ul", "fen", "qua", "zer", "pho", "ny", "ast", "orm"]

CODE_TEMPLATES = [
    "def {f}({a}, {b}):\n    \"\"\"Return the {n} of {a} and {b}.\"\"\"\n"
    "    if {a} is None:\n        return {b}\n    return {a} + {b}\n",
    "for {a} in range({k}):\n    {b} = {f}({a})\n    print(f\"{{{a}}}: {{{b}}}\")\n",
    "class {C}:\n    def __init__(self, {a}: int) -> None:\n        self.{a} = {a}\n\n"
    "    def {f}(self) -> int:\n        return self.{a} * {k}\n",
    "function {f}({a}, {b}) {{\n  const {n} = {a}.map((x) => x * {k});\n"
    "  return {n}.filter(Boolean).length + {b};\n}}\n",
    "int {f}(const int *{a}, size_t {b}) {{\n    int {n} = 0;\n"
    "    for (size_t i = 0; i < {b}; ++i) {n} += {a}[i];\n    return {n};\n}}\n",
    "import torch\n\n{a} = torch.randn({k}, {k})\n{b} = torch.softmax({a}, dim=-1)\n"
    "assert {b}.shape == ({k}, {k})\n",
    "{{\"name\": \"{f}\", \"arguments\": {{\"{a}\": {k}, \"{b}\": \"{n}\"}}}}\n",
]
IDENTS = ["x", "y", "value", "total", "count", "items", "left", "right", "data", "buf",
          "index", "result", "scale", "offset", "batch", "tokens"]
FUNCS = ["compute", "merge", "load", "parse", "render", "update", "step", "decode",
         "encode", "sample", "flush", "schedule"]
CLASSES = ["Buffer", "Engine", "Request", "Scheduler", "Block", "Tokenizer", "Runner"]


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(PLACES)}"
    elif kind == 1:
        s = (f"{rng.choice(PLACES)}, {rng.choice(SUBJECTS)} {rng.choice(VERBS)} "
             f"{rng.choice(OBJECTS)} {rng.choice(REASONS)}")
    elif kind == 2:
        s = (f"the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} was "
             f"{rng.choice(ADJECTIVES)}, and the {rng.choice(NOUNS)} was not")
    elif kind == 3:
        s = (f"why {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} "
             f"is still a {rng.choice(ADJECTIVES)} question")
    else:
        n = rng.randrange(2, 9999)
        s = (f"{rng.choice(SUBJECTS)} counted {n} {rng.choice(NOUNS)}s and "
             f"{rng.choice(VERBS)} {rng.randrange(1, 100)} of them")
    end = "?" if kind == 3 else rng.choice([".", ".", ".", "!"])
    return s[0].upper() + s[1:] + end


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(SYLLABLES) for _ in range(rng.randrange(2, 4))).capitalize()


def _glossary(rng: random.Random) -> str:
    """An encyclopedia-like line: invented names plus words from the broad list."""
    w = [x + rng.choice(SUFFIXES) for x in rng.sample(WORDS, 6)]
    year = rng.randrange(1200, 2030)
    return (f"{_name(rng)} ({year}) is a {w[0]} {w[1]} of {_name(rng)}, known for its "
            f"{w[2]} {w[3]}; see also {w[4]}, {w[5]} and {_name(rng)}.")


def _code(rng: random.Random) -> str:
    a, b, n = rng.sample(IDENTS, 3)
    return rng.choice(CODE_TEMPLATES).format(
        a=a, b=b, n=n, f=rng.choice(FUNCS), C=rng.choice(CLASSES), k=rng.randrange(2, 64))


def _chat(rng: random.Random) -> str:
    q = _sentence(rng)
    a = " ".join(_sentence(rng) for _ in range(rng.randrange(1, 4)))
    think = f"<think>\nThe user says: {q}\n</think>\n\n" if rng.random() < 0.5 else ""
    return (f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{think}{a}<|im_end|>\n"
            "<|endoftext|>")


def build_corpus(target_bytes: int = 180_000, seed: int = 20240601) -> str:
    """Deterministic mixed corpus of about `target_bytes` UTF-8 bytes."""
    rng = random.Random(seed)
    parts: list[str] = list(PARAGRAPHS)
    size = sum(len(p.encode()) for p in parts)
    while size < target_bytes:
        r = rng.random()
        if r < 0.35:
            chunk = " ".join(_sentence(rng) for _ in range(rng.randrange(3, 8)))
        elif r < 0.55:
            chunk = " ".join(_glossary(rng) for _ in range(rng.randrange(1, 4)))
        elif r < 0.70:
            chunk = _code(rng)
        elif r < 0.80:
            chunk = "".join(p + rng.choice(CJK_PUNCT) for p in rng.sample(CJK, 3))
        elif r < 0.87:
            chunk = f"{_sentence(rng)} {rng.choice(EMOJI)} {rng.choice(EMOJI)}"
        elif r < 0.95:
            chunk = _chat(rng)
        else:
            chunk = rng.choice(PARAGRAPHS)
        parts.append(chunk)
        size += len(chunk.encode()) + 2
    return "\n\n".join(parts) + "\n"
