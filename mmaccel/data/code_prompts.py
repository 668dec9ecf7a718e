"""Code prompt sets of the speculative-decoding bench: a coder model's free and copy-heavy regimes, built offline.

- ``code-completion`` (free): a Python function's signature and docstring; the answer is its body, which the prompt
  does not contain (only the names it uses).
- ``code-edit`` (copy-heavy): a whole function and an instruction to change it (rename a variable, rename the
  function, add a keyword parameter); the answer repeats the function with the change, so most of it can be copied
  from the prompt (the regime of prompt lookup: Saxena, "Prompt Lookup Decoding", 2023; of the edit tasks of
  Spec-Bench: Xia et al., 2024, arXiv 2401.07851).

The functions are written here (no downloads); a seed picks their order, the edit of each and its new names.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

CODE_PROMPT_SETS = ("code-completion", "code-edit")

#: (signature, docstring, body, local variables an edit may rename); each body is indented by four spaces
FUNCTIONS = (
    ("def moving_average(values, window):",
     "Return the averages of every run of `window` consecutive values, in order.",
     "    if window <= 0:\n        raise ValueError('window must be positive')\n    averages = []\n"
     "    total = sum(values[:window])\n    averages.append(total / window)\n"
     "    for i in range(window, len(values)):\n        total += values[i] - values[i - window]\n"
     "        averages.append(total / window)\n    return averages\n",
     ("averages", "total")),
    ("def word_counts(text):",
     "Count how often each lower-cased word occurs in `text`; return a dict sorted by decreasing count.",
     "    counts = {}\n    for word in text.lower().split():\n        word = word.strip('.,;:!?')\n"
     "        if word:\n            counts[word] = counts.get(word, 0) + 1\n"
     "    ordered = sorted(counts.items(), key=lambda item: item[1], reverse=True)\n    return dict(ordered)\n",
     ("counts", "ordered")),
    ("def binary_search(items, target):",
     "Return the index of `target` in the sorted list `items`, or -1 if it is absent.",
     "    low, high = 0, len(items) - 1\n    while low <= high:\n        middle = (low + high) // 2\n"
     "        if items[middle] == target:\n            return middle\n        if items[middle] < target:\n"
     "            low = middle + 1\n        else:\n            high = middle - 1\n    return -1\n",
     ("middle", "low")),
    ("def flatten(nested):",
     "Flatten arbitrarily nested lists and tuples into one flat list, keeping the order of the elements.",
     "    result = []\n    stack = [iter(nested)]\n    while stack:\n        for element in stack[-1]:\n"
     "            if isinstance(element, (list, tuple)):\n                stack.append(iter(element))\n"
     "                break\n            result.append(element)\n        else:\n            stack.pop()\n"
     "    return result\n",
     ("result", "stack")),
    ("def parse_key_values(line):",
     "Parse a line such as 'a=1; b=two' into a dict of stripped keys and values; skip empty parts.",
     "    pairs = {}\n    for part in line.split(';'):\n        part = part.strip()\n        if not part:\n"
     "            continue\n        key, _, value = part.partition('=')\n"
     "        pairs[key.strip()] = value.strip()\n    return pairs\n",
     ("pairs", "part")),
    ("def chunk(sequence, size):",
     "Split `sequence` into consecutive lists of `size` elements; the last one may be shorter.",
     "    if size < 1:\n        raise ValueError('size must be at least 1')\n    chunks = []\n"
     "    for start in range(0, len(sequence), size):\n        chunks.append(list(sequence[start:start + size]))\n"
     "    return chunks\n",
     ("chunks", "start")),
    ("def is_palindrome(text):",
     "Tell whether `text` reads the same backwards, ignoring case, spaces and punctuation.",
     "    letters = [c.lower() for c in text if c.isalnum()]\n    left, right = 0, len(letters) - 1\n"
     "    while left < right:\n        if letters[left] != letters[right]:\n            return False\n"
     "        left += 1\n        right -= 1\n    return True\n",
     ("letters", "left")),
    ("def merge_intervals(intervals):",
     "Merge overlapping (start, end) intervals and return them sorted by start.",
     "    merged = []\n    for start, end in sorted(intervals):\n        if merged and start <= merged[-1][1]:\n"
     "            merged[-1] = (merged[-1][0], max(merged[-1][1], end))\n        else:\n"
     "            merged.append((start, end))\n    return merged\n",
     ("merged", "end")),
    ("def celsius_table(start, stop, step):",
     "Return lines 'C -> F' converting Celsius temperatures from `start` to `stop` (inclusive) every `step`.",
     "    lines = []\n    degrees = start\n    while degrees <= stop:\n        fahrenheit = degrees * 9 / 5 + 32\n"
     "        lines.append(f'{degrees} -> {fahrenheit:.1f}')\n        degrees += step\n    return lines\n",
     ("lines", "fahrenheit")),
    ("def group_by_length(words):",
     "Group `words` by their length: a dict from length to the words of that length, in input order.",
     "    groups = {}\n    for word in words:\n        size = len(word)\n        if size not in groups:\n"
     "            groups[size] = []\n        groups[size].append(word)\n    return groups\n",
     ("groups", "size")),
    ("def running_max(numbers):",
     "Return the list whose i-th element is the largest of the first i + 1 numbers.",
     "    maxima = []\n    best = None\n    for number in numbers:\n"
     "        if best is None or number > best:\n            best = number\n        maxima.append(best)\n"
     "    return maxima\n",
     ("maxima", "best")),
    ("def caesar_shift(text, shift):",
     "Shift every ASCII letter of `text` by `shift` places in the alphabet, keeping case; other characters stay.",
     "    shifted = []\n    for char in text:\n        if char.isascii() and char.isalpha():\n"
     "            base = ord('a') if char.islower() else ord('A')\n"
     "            shifted.append(chr((ord(char) - base + shift) % 26 + base))\n        else:\n"
     "            shifted.append(char)\n    return ''.join(shifted)\n",
     ("shifted", "base")),
)

#: new names an edit prompt asks for (picked by the seed)
NEW_NAMES = ("acc", "buffer", "collected", "current", "found", "items_out", "pos", "state", "tally", "value_list")
#: (parameter, default, what it does) of the add-parameter edits
NEW_PARAMETERS = (
    ("verbose", "False", "when true, print each intermediate result before returning"),
    ("strict", "False", "when true, raise ValueError if the input is empty"),
    ("limit", "None", "when given, return at most that many elements of the result"),
)


@dataclass(frozen=True)
class CodePrompt:
    """One code prompt, before tokenization.

    Attributes
    ----------
    task : {"complete", "rename_variable", "rename_function", "add_parameter"}
    user : str
        The user turn (instruction and code).
    lead : str
        The start of the answer (a code fence, for completion the signature and docstring too), appended after the
        chat template's generation prompt, so that base models answer in code as well.
    function : str
        Name of the function the prompt is about.
    """

    task: str
    user: str
    lead: str
    function: str


def _header(signature: str, doc: str) -> str:
    return f'{signature}\n    """{doc}"""\n'


def code_prompts(name: str, n: int = 8, seed: int = 0) -> list[CodePrompt]:
    """The prompts of one code set, deterministic for a seed.

    Parameters
    ----------
    name : {"code-completion", "code-edit"}
    n : int
        Prompts, ``1 <= n <= len(FUNCTIONS)`` (12): one distinct function each.
    seed : int
        Picks the functions' order and, for edits, the task, the variable and the new names.

    Returns
    -------
    list of CodePrompt
        Completion prompts hold a signature and docstring and no body; edit prompts hold a whole function and an
        instruction naming the change.

    Raises
    ------
    ValueError
        An unknown set name or ``n`` outside ``1 .. 12``.
    """
    if name not in CODE_PROMPT_SETS:
        raise ValueError(f"unknown code prompt set {name!r}; choose {' or '.join(CODE_PROMPT_SETS)}")
    if not 1 <= n <= len(FUNCTIONS):
        raise ValueError(f"the code prompt sets have {len(FUNCTIONS)} functions; ask for 1 to {len(FUNCTIONS)} "
                         f"prompts, got {n}")
    rng = random.Random(f"{name}:{seed}")
    out = []
    for i, (signature, doc, body, variables) in enumerate(rng.sample(FUNCTIONS, n)):
        fname = signature[4:signature.index("(")]
        header = _header(signature, doc)
        if name == "code-completion":
            user = ("Complete the following Python function. Reply with the whole function in one code block.\n\n"
                    f"```python\n{header}```")
            out.append(CodePrompt("complete", user, f"```python\n{header}", fname))
            continue
        task = ("rename_variable", "rename_function", "add_parameter")[(i + rng.randrange(3)) % 3]
        if task == "rename_variable":
            old, new = rng.choice(variables), rng.choice(NEW_NAMES)
            instruction = f"Rename the variable `{old}` to `{new}` everywhere in the following function."
        elif task == "rename_function":
            new = rng.choice(("compute_", "get_", "make_")) + fname
            instruction = f"Rename the function `{fname}` to `{new}`; change nothing else."
        else:
            param, default, effect = rng.choice(NEW_PARAMETERS)
            instruction = (f"Add a keyword parameter `{param}={default}` to the following function: {effect}. "
                           "Mention it in the docstring.")
        user = f"{instruction} Reply with the whole changed function in one code block.\n\n```python\n{header}{body}```"
        out.append(CodePrompt(task, user, "```python\n", fname))
    return out
