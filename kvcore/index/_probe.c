/* kvcore.index._probe: a prompt's leading runs read from a KeyTable in one C pass.
 *
 * Why: numpy reads a long prompt's keys out of the compact index in a dozen array
 * operations, each a pass over the prompt with its own fixed cost, and a Python int
 * becomes a uint64 only through an array; here each key is converted, hashed, probed
 * and its bitset ANDed into the run once. The table's layout and probing are those of
 * kvcore/index/hashtable.py (the Python side is the reference; the conformance suite
 * runs both): slot s holds keys[s] and the bitset row masks[s * words .. + words], key 0
 * marks a never-used slot, a key's home is (key * multiplier) >> (64 - bits), probes are
 * triangular (home, +1, +3, +6, ...).
 *
 * Two passes over the prompt: the first converts every key (so that a bad one raises as
 * numpy's conversion does, whatever comes after it) and computes its home slot; the
 * second probes, ORs in speculation (looked up only where a replica still in the run
 * lacks the key confirmed: elsewhere it cannot change the run), drops hidden replicas
 * and ANDs the row into the replicas still in the run, recording where each one leaves
 * it. While it probes a key it asks the memory for the home slot of the key
 * PREFETCH_AHEAD places on (a long prompt's keys are mostly in no cache, and their
 * fetches then overlap; asked much earlier, as for a whole prompt at once, they would be
 * out of the TLB again by the time they are read).
 *
 * change() applies an add or a remove of one replica's keys the same way, in place: one
 * pass converting the keys, one probing each key and setting or clearing its bit. A new
 * key takes the first tombstone (a removed key's slot, its row all zero) its probe
 * passed, else the never-used slot the probe ended at (as KeyTable.insert gives it): an
 * engine evicts as many blocks as it stores, so a proxy's table at a steady size reuses
 * some of its evicted keys' slots and is rebuilt less often (1M keys: after ~620,000
 * stored keys instead of ~470,000). Why: a proxy applies an engine's few dozen stored
 * and evicted blocks between two requests; numpy's dozens of array operations cost ~100
 * us for 100 keys and left the next decision's code and data out of the caches (its p99
 * doubled under 200,000 block events/s); here the same change is a few microseconds and
 * touches only its slots.
 *
 * rebuild() moves a slot range of a table into a new one: the index rebuilds a table in
 * steps, a range per change, and meanwhile leading_runs() and change() read a key absent
 * from the new table in the old one, from its first slot not moved yet (numpy's rebuild
 * at once held a proxy's event loop a few hundred milliseconds at 1M keys).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_WORDS 64 /* 4096 replicas */
#define PREFETCH_AHEAD 16 /* keys whose slots are asked for before they are probed */

typedef struct {
    Py_buffer view;
    int held;
} Buffer;

static int
get_buffer(PyObject *obj, Buffer *buffer, Py_ssize_t items, const char *what, int flags)
{
    buffer->held = 0;
    if (PyObject_GetBuffer(obj, &buffer->view, PyBUF_C_CONTIGUOUS | flags) < 0)
        return -1;
    buffer->held = 1;
    if (buffer->view.len < items * (Py_ssize_t)sizeof(uint64_t)) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, fewer than %zd uint64",
                     what, buffer->view.len, items);
        return -1;
    }
    return 0;
}

static void
release(Buffer *buffer)
{
    if (buffer->held)
        PyBuffer_Release(&buffer->view);
    buffer->held = 0;
}

/* A KeyTable's arrays and layout, from the arguments table_keys, table_masks, bits,
 * multiplier, words. */
typedef struct {
    Buffer keys, masks;
    uint64_t capacity, wrap, multiplier;
    unsigned shift;
    Py_ssize_t words;
} Table;

static int
open_table(PyObject *const *args, Table *table, int flags)
{
    long bits = PyLong_AsLong(args[2]);
    if (bits == -1 && PyErr_Occurred())
        return -1;
    table->multiplier = PyLong_AsUnsignedLongLong(args[3]);
    if (table->multiplier == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    table->words = PyLong_AsSsize_t(args[4]);
    if (table->words == -1 && PyErr_Occurred())
        return -1;
    if (bits < 1 || bits > 62 || table->words < 1 || table->words > MAX_WORDS) {
        PyErr_SetString(PyExc_ValueError, "bits must be in [1, 62] and words in [1, 64]");
        return -1;
    }
    table->capacity = (uint64_t)1 << bits;
    table->wrap = table->capacity - 1;
    table->shift = 64 - (unsigned)bits;
    Py_ssize_t rows = (Py_ssize_t)table->capacity + 1;
    if (get_buffer(args[0], &table->keys, rows, "table_keys", flags) < 0
        || get_buffer(args[1], &table->masks, rows * table->words, "table_masks", flags) < 0)
        return -1;
    return 0;
}

static void
close_table(Table *table)
{
    release(&table->keys);
    release(&table->masks);
}

/* Each word of a speculative mask (a Python int, any size) ORed into row. */
static int
or_mask(PyObject *mask, uint64_t *row, Py_ssize_t words)
{
    if (words == 1) {
        uint64_t word = PyLong_AsUnsignedLongLongMask(mask);
        if (word == (uint64_t)-1 && PyErr_Occurred())
            return -1;
        row[0] |= word;
        return 0;
    }
    for (Py_ssize_t w = 0; w < words; w++) {
        PyObject *shift = PyLong_FromSsize_t(64 * w);
        if (shift == NULL)
            return -1;
        PyObject *part = PyNumber_Rshift(mask, shift);
        Py_DECREF(shift);
        if (part == NULL)
            return -1;
        uint64_t word = PyLong_AsUnsignedLongLongMask(part);
        Py_DECREF(part);
        if (word == (uint64_t)-1 && PyErr_Occurred())
            return -1;
        row[w] |= word;
    }
    return 0;
}

/* Record, in runs, run = end for every replica in live but not in kept (lowest first). */
static int
record_ends(PyObject *runs, const uint64_t *live, const uint64_t *kept, Py_ssize_t words,
            Py_ssize_t end)
{
    for (Py_ssize_t w = 0; w < words; w++) {
        uint64_t gone = live[w] & ~kept[w];
        while (gone) {
            int bit = __builtin_ctzll(gone);
            gone &= gone - 1;
            PyObject *replica = PyLong_FromSsize_t(64 * w + bit);
            PyObject *run = PyLong_FromSsize_t(end);
            int failed = replica == NULL || run == NULL || PyDict_SetItem(runs, replica, run) < 0;
            Py_XDECREF(replica);
            Py_XDECREF(run);
            if (failed)
                return -1;
        }
    }
    return 0;
}

/* keys[i] as a uint64 (a numpy integer, a bool, ...: what it stands for as an int);
 * -1 with an exception set if it is not an int in [0, 2**64). */
static int
convert_key(PyObject *item, uint64_t *key)
{
    if (PyLong_CheckExact(item)) {
        *key = PyLong_AsUnsignedLongLong(item);
    } else {
        PyObject *number = PyNumber_Index(item);
        if (number == NULL)
            return -1;
        *key = PyLong_AsUnsignedLongLong(number);
        Py_DECREF(number);
    }
    return *key == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* Every key of items converted (all before any is used, so that a bad one raises
 * whatever comes after it) with its home slot, the first PREFETCH_AHEAD homes asked for. */
static int
convert_keys(PyObject **items, Py_ssize_t n, uint64_t multiplier, unsigned shift,
             const uint64_t *table, const uint64_t *masks, Py_ssize_t words,
             uint64_t *converted, uint64_t *homes)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        if (convert_key(items[i], &converted[i]) < 0)
            return -1;
        homes[i] = (converted[i] * multiplier) >> shift;
        if (i < PREFETCH_AHEAD) {
            __builtin_prefetch(&table[homes[i]]);
            __builtin_prefetch(&masks[homes[i] * words]);
        }
    }
    return 0;
}

/* The slot of key (non-zero) probed from home: where it is (*found = 1), else the
 * never-used slot its probe ended at (*found = 0). */
static inline uint64_t
probe(const uint64_t *table, uint64_t key, uint64_t home, uint64_t wrap, int *found)
{
    uint64_t slot = home, step = 0;
    for (;;) {
        uint64_t seen = table[slot];
        if (seen == key || seen == 0) {
            *found = seen == key;
            return slot;
        }
        step++;
        slot = (slot + step) & wrap;
    }
}

static inline int
row_empty(const uint64_t *row, Py_ssize_t words)
{
    for (Py_ssize_t w = 0; w < words; w++)
        if (row[w])
            return 0;
    return 1;
}

/* probe(), for a key to add: where it is (*found = 1), else the first tombstone (a slot
 * whose row is all zero) its probe passed (*reused = 1), else the never-used slot the
 * probe ended at. The probe goes on past tombstones to the key or a never-used slot, so
 * a key is never placed twice. */
static inline uint64_t
probe_free(const uint64_t *table, const uint64_t *masks, Py_ssize_t words, uint64_t key,
           uint64_t home, uint64_t wrap, int *found, int *reused)
{
    uint64_t slot = home, step = 0, tombstone = 0;
    *reused = 0;
    for (;;) {
        uint64_t seen = table[slot];
        if (seen == key || seen == 0) {
            *found = seen == key;
            if (*found || !*reused)
                return slot;
            return tombstone;
        }
        if (!*reused && row_empty(&masks[slot * words], words)) {
            *reused = 1;
            tombstone = slot;
        }
        step++;
        slot = (slot + step) & wrap;
    }
}

/* The table a resize in steps is moving out of (kvcore/index/compact.py): its slots from
 * `moved` on still hold their keys' rows; a key found before `moved` was moved to the
 * new table already, or was a tombstone then. From the arguments old_keys, old_masks,
 * old_bits, moved (old_keys None: no resize under way); multiplier and words are the new
 * table's. */
typedef struct {
    Table t;
    int on;
    uint64_t moved;
} Old;

static int
open_old(PyObject *const *args, PyObject *multiplier, PyObject *words, Old *old, int flags)
{
    old->on = args[0] != Py_None;
    if (!old->on)
        return 0;
    PyObject *table[5] = {args[0], args[1], args[2], multiplier, words};
    if (open_table(table, &old->t, flags) < 0)
        return -1;
    old->moved = PyLong_AsUnsignedLongLong(args[3]);
    return old->moved == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* key's row in the old table if it is there from `moved` on, else NULL. */
static inline uint64_t *
old_row(const Old *old, uint64_t key)
{
    if (!old->on)
        return NULL;
    int found;
    uint64_t home = (key * old->t.multiplier) >> old->t.shift;
    uint64_t slot = probe(old->t.keys.view.buf, key, home, old->t.wrap, &found);
    if (!found || slot < old->moved)
        return NULL;
    return (uint64_t *)old->t.masks.view.buf + slot * old->t.words;
}

PyDoc_STRVAR(leading_runs_doc,
"leading_runs(keys, table_keys, table_masks, bits, multiplier, words, zero, spec, hidden,\n"
"             old_keys, old_masks, old_bits, moved)\n"
"\n"
"Each replica's leading run over keys (a list or tuple of ints in [0, 2**64)), read\n"
"from a KeyTable's arrays (table_keys: capacity + 1 uint64, table_masks: (capacity + 1)\n"
"x words uint64, both C-contiguous; capacity = 2**bits). zero: the bitset row of key 0\n"
"(words uint64); spec: None or a dict of key -> speculative mask (an int) ORed in;\n"
"hidden: None or a row of replicas to leave out; old_keys .. moved: the table a resize\n"
"in steps moves out of (keys absent from the first are read there from slot moved on),\n"
"or old_keys None. Runs in the order they end, lowest replica first among those ending\n"
"together.");

static PyObject *
leading_runs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "leading_runs takes 13 arguments");
        return NULL;
    }
    PyObject *keys = args[0], *spec = args[7];
    if (spec != Py_None && !PyDict_Check(spec)) {
        PyErr_SetString(PyExc_TypeError, "spec must be a dict or None");
        return NULL;
    }
    if (spec != Py_None && PyDict_GET_SIZE(spec) == 0)
        spec = Py_None;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Table t = {0};
    Old old = {0};
    Buffer zero = {0}, hidden = {0};
    uint64_t *converted = NULL;
    PyObject *runs = NULL;
    if (open_table(args + 1, &t, 0) < 0
        || get_buffer(args[6], &zero, t.words, "zero", 0) < 0
        || (args[8] != Py_None && get_buffer(args[8], &hidden, t.words, "hidden", 0) < 0)
        || open_old(args + 9, args[4], args[5], &old, 0) < 0)
        goto done;
    const uint64_t *table = t.keys.view.buf, *masks = t.masks.view.buf;
    const uint64_t *zero_row = zero.view.buf;
    const uint64_t *hidden_row = hidden.held ? hidden.view.buf : NULL;
    Py_ssize_t words = t.words;
    converted = PyMem_Malloc((n ? 2 * n : 1) * sizeof(uint64_t));
    if (converted == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *homes = converted + n;
    if (convert_keys(items, n, t.multiplier, t.shift, table, masks, words, converted, homes) < 0)
        goto done;
    runs = PyDict_New();
    if (runs == NULL)
        goto done;
    uint64_t live[MAX_WORDS], row[MAX_WORDS], kept[MAX_WORDS];
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key = converted[i];
        const uint64_t *held = zero_row;
        if (i + PREFETCH_AHEAD < n) {
            __builtin_prefetch(&table[homes[i + PREFETCH_AHEAD]]);
            __builtin_prefetch(&masks[homes[i + PREFETCH_AHEAD] * words]);
        }
        if (key != 0) {
            int found;
            uint64_t slot = probe(table, key, homes[i], t.wrap, &found);
            held = &masks[(found ? slot : t.capacity) * words]; /* (the absent row: all zero) */
            const uint64_t *moving = found ? NULL : old_row(&old, key);
            if (moving != NULL)
                held = moving;
        }
        memcpy(row, held, words * sizeof(uint64_t));
        /* Speculation matters only for a replica still in the run that lacks the key:
         * along a run its holders already hold it, so most keys skip the dict. */
        int lacking = i == 0;
        for (Py_ssize_t w = 0; w < words && !lacking; w++)
            lacking = (live[w] & ~row[w]) != 0;
        if (spec != Py_None && lacking) {
            PyObject *mask = PyDict_GetItemWithError(spec, items[i]);
            if (mask == NULL && PyErr_Occurred())
                goto fail;
            if (mask != NULL && or_mask(mask, row, words) < 0)
                goto fail;
        }
        uint64_t any = 0;
        for (Py_ssize_t w = 0; w < words; w++) {
            if (hidden_row != NULL)
                row[w] &= ~hidden_row[w];
            kept[w] = i ? live[w] & row[w] : row[w];
            any |= kept[w];
        }
        if (i && memcmp(kept, live, words * sizeof(uint64_t)) != 0
            && record_ends(runs, live, kept, words, i) < 0)
            goto fail;
        if (!any)
            goto done;
        memcpy(live, kept, words * sizeof(uint64_t));
    }
    if (n) {
        uint64_t none[MAX_WORDS] = {0};
        if (record_ends(runs, live, none, words, n) < 0)
            goto fail;
    }
    goto done;
fail:
    Py_CLEAR(runs);
done:
    if (PyErr_Occurred())
        Py_CLEAR(runs);
    PyMem_Free(converted);
    close_table(&t);
    close_table(&old.t);
    release(&zero);
    release(&hidden);
    Py_DECREF(seq);
    return runs;
}

PyDoc_STRVAR(change_doc,
"change(keys, table_keys, table_masks, bits, multiplier, words, replica, added, room, start,\n"
"       old_keys, old_masks, old_bits, moved)\n"
"\n"
"Add (added true) or remove replica's bit on each key of keys[start:] (a list or tuple\n"
"of ints in [0, 2**64)) in a KeyTable's arrays (as leading_runs; both written in\n"
"place); a new key takes the first tombstone its probe passes, else the never-used\n"
"slot it ends at (at most room of those).\n"
"Key 0 is left to the caller. Returns (done, changed, live, placed, zero): keys[start:\n"
"done] applied (done < len(keys): the next key needed a slot beyond room), how many\n"
"bits were set or cleared, the change in rows with any bit, the slots newly used, and\n"
"whether key 0 was among the keys applied. Nothing is changed if a key is not an int\n"
"in [0, 2**64). old_keys .. moved: as leading_runs's (a key absent from the first table\n"
"and in the old from slot moved on is changed there, in place); then a sixth item: the\n"
"change in the old table's rows with any bit (included in live).");

/* Add or remove one replica's bit on one key: found, its row; else (when added) the
 * row and key cell of a tombstone, reused, or of a never-used slot, taken from room;
 * -1: no room. */
static inline int
apply_key(uint64_t *cell, uint64_t *row, Py_ssize_t words, uint64_t key, int found,
          int reused, Py_ssize_t word, uint64_t bit, int added, Py_ssize_t *room,
          Py_ssize_t *changed, Py_ssize_t *live, Py_ssize_t *placed)
{
    if (!found) {
        if (!added)
            return 0;
        if (!reused) {
            if (*room == 0)
                return -1;
            --*room, ++*placed;
        }
        *cell = key; /* (the row of a tombstone or a never-used slot is all zero) */
        row[word] = bit;
        ++*live, ++*changed;
    } else if (added && !(row[word] & bit)) {
        *live += row_empty(row, words);
        row[word] |= bit;
        ++*changed;
    } else if (!added && (row[word] & bit)) {
        row[word] &= ~bit;
        *live -= row_empty(row, words);
        ++*changed;
    }
    return 0;
}

static PyObject *
change(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "change takes 14 arguments");
        return NULL;
    }
    Py_ssize_t replica = PyLong_AsSsize_t(args[6]);
    int added = PyObject_IsTrue(args[7]);
    Py_ssize_t room = PyLong_AsSsize_t(args[8]), start = PyLong_AsSsize_t(args[9]);
    if (PyErr_Occurred() || added < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "keys must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Table t = {0};
    Old old = {0};
    uint64_t *converted = NULL;
    PyObject *result = NULL;
    if (open_table(args + 1, &t, PyBUF_WRITABLE) < 0
        || open_old(args + 10, args[4], args[5], &old, PyBUF_WRITABLE) < 0)
        goto done;
    if (replica < 0 || replica >= 64 * t.words || room < 0 || start < 0 || start > n) {
        PyErr_SetString(PyExc_ValueError,
                        "replica must be in [0, 64 * words), room >= 0, start in [0, len(keys)]");
        goto done;
    }
    uint64_t *table = t.keys.view.buf, *masks = t.masks.view.buf;
    Py_ssize_t words = t.words, count = n - start, i = 0;
    converted = PyMem_Malloc((count ? 2 * count : 1) * sizeof(uint64_t));
    if (converted == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *homes = converted + count;
    if (convert_keys(PySequence_Fast_ITEMS(seq) + start, count, t.multiplier, t.shift, table,
                     masks, words, converted, homes) < 0)
        goto done;
    Py_ssize_t word = replica >> 6, changed = 0, live = 0, old_live = 0, placed = 0;
    uint64_t bit = (uint64_t)1 << (replica & 63);
    int zero = 0;
    for (; i < count; i++) {
        if (i + PREFETCH_AHEAD < count) {
            __builtin_prefetch(&table[homes[i + PREFETCH_AHEAD]]);
            __builtin_prefetch(&masks[homes[i + PREFETCH_AHEAD] * words]);
        }
        uint64_t key = converted[i];
        if (key == 0) {
            zero = 1;
            continue;
        }
        int found, reused = 0;
        uint64_t slot = added ? probe_free(table, masks, words, key, homes[i], t.wrap, &found,
                                           &reused)
                              : probe(table, key, homes[i], t.wrap, &found);
        uint64_t *row = &masks[slot * words], *moving = found ? NULL : old_row(&old, key);
        if (moving != NULL) /* (not moved yet: changed where it stands) */
            found = 1, row = moving;
        if (apply_key(&table[slot], row, words, key, found, reused, word, bit, added, &room,
                      &changed, moving != NULL ? &old_live : &live, &placed) < 0)
            break;
    }
    result = Py_BuildValue("(nnnnOn)", start + i, changed, live + old_live, placed,
                           zero ? Py_True : Py_False, old_live);
done:
    PyMem_Free(converted);
    close_table(&t);
    close_table(&old.t);
    Py_DECREF(seq);
    return result;
}

PyDoc_STRVAR(rebuild_doc,
"rebuild(table_keys, table_masks, bits, multiplier, words, new_keys, new_masks, new_bits,\n"
"        start, stop, room)\n"
"\n"
"Place every key of a KeyTable's slots start to stop whose row has a bit (tombstones\n"
"dropped) with its row in another KeyTable of the same words and multiplier (new_keys,\n"
"new_masks: 2**new_bits + 1 rows, written in place; none of those keys in it), each in\n"
"the never-used slot its probe there ends at, at most room of them (ValueError past\n"
"it: the caller makes the table big enough). Returns how many were placed.");

#define REBUILD_BATCH 32 /* rows whose new homes are asked for before they are placed */

static PyObject *
rebuild(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 11) {
        PyErr_SetString(PyExc_TypeError, "rebuild takes 11 arguments");
        return NULL;
    }
    PyObject *into[5] = {args[5], args[6], args[7], args[3], args[4]};
    Table from = {0}, to = {0};
    PyObject *result = NULL;
    uint64_t start = PyLong_AsUnsignedLongLong(args[8]), stop = PyLong_AsUnsignedLongLong(args[9]);
    Py_ssize_t room = PyLong_AsSsize_t(args[10]);
    if (PyErr_Occurred())
        return NULL;
    if (open_table(args, &from, 0) < 0 || open_table(into, &to, PyBUF_WRITABLE) < 0)
        goto done;
    if (stop > from.capacity)
        stop = from.capacity;
    if (to.words != from.words || to.multiplier != from.multiplier) {
        PyErr_SetString(PyExc_ValueError, "both tables need the same words and multiplier");
        goto done;
    }
    const uint64_t *keys = from.keys.view.buf, *masks = from.masks.view.buf;
    uint64_t *new_keys = to.keys.view.buf, *new_masks = to.masks.view.buf;
    Py_ssize_t words = from.words, placed = 0, bytes = words * sizeof(uint64_t);
    uint64_t slots[REBUILD_BATCH], homes[REBUILD_BATCH];
    uint64_t slot = start;
    while (slot < stop) {
        int batch = 0;
        for (; slot < stop && batch < REBUILD_BATCH; slot++) {
            if (row_empty(&masks[slot * words], words))
                continue;
            slots[batch] = slot;
            homes[batch] = (keys[slot] * to.multiplier) >> to.shift;
            __builtin_prefetch(&new_keys[homes[batch]], 1);
            __builtin_prefetch(&new_masks[homes[batch] * words], 1);
            batch++;
        }
        for (int b = 0; b < batch; b++) {
            if (placed >= room) { /* (a probe must meet a never-used slot) */
                PyErr_SetString(PyExc_ValueError, "the new table is too small");
                goto done;
            }
            int found;
            uint64_t at = probe(new_keys, keys[slots[b]], homes[b], to.wrap, &found);
            if (found) { /* (a key in two slots: never, but not written twice) */
                PyErr_SetString(PyExc_ValueError, "a key stands in two slots");
                goto done;
            }
            new_keys[at] = keys[slots[b]];
            memcpy(&new_masks[at * words], &masks[slots[b] * words], bytes);
            placed++;
        }
    }
    result = PyLong_FromSsize_t(placed);
done:
    close_table(&from);
    close_table(&to);
    return result;
}

static PyMethodDef methods[] = {
    {"leading_runs", (PyCFunction)(void (*)(void))leading_runs, METH_FASTCALL, leading_runs_doc},
    {"change", (PyCFunction)(void (*)(void))change, METH_FASTCALL, change_doc},
    {"rebuild", (PyCFunction)(void (*)(void))rebuild, METH_FASTCALL, rebuild_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcore.index._probe",
    "A KeyTable's prompt lookups and small changes, each in one C pass.", -1, methods,
};

PyMODINIT_FUNC
PyInit__probe(void)
{
    return PyModule_Create(&module);
}
