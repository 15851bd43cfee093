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
get_buffer(PyObject *obj, Buffer *buffer, Py_ssize_t items, const char *what)
{
    buffer->held = 0;
    if (PyObject_GetBuffer(obj, &buffer->view, PyBUF_C_CONTIGUOUS) < 0)
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

PyDoc_STRVAR(leading_runs_doc,
"leading_runs(keys, table_keys, table_masks, bits, multiplier, words, zero, spec, hidden)\n"
"\n"
"Each replica's leading run over keys (a list or tuple of ints in [0, 2**64)), read\n"
"from a KeyTable's arrays (table_keys: capacity + 1 uint64, table_masks: (capacity + 1)\n"
"x words uint64, both C-contiguous; capacity = 2**bits). zero: the bitset row of key 0\n"
"(words uint64); spec: None or a dict of key -> speculative mask (an int) ORed in;\n"
"hidden: None or a row of replicas to leave out. Runs in the order they end, lowest\n"
"replica first among those ending together.");

static PyObject *
leading_runs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "leading_runs takes 9 arguments");
        return NULL;
    }
    PyObject *keys = args[0], *spec = args[7];
    long bits = PyLong_AsLong(args[3]);
    if (bits == -1 && PyErr_Occurred())
        return NULL;
    uint64_t multiplier = PyLong_AsUnsignedLongLong(args[4]);
    if (multiplier == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t words = PyLong_AsSsize_t(args[5]);
    if (words == -1 && PyErr_Occurred())
        return NULL;
    if (bits < 1 || bits > 62 || words < 1 || words > MAX_WORDS) {
        PyErr_SetString(PyExc_ValueError, "bits must be in [1, 62] and words in [1, 64]");
        return NULL;
    }
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
    uint64_t capacity = (uint64_t)1 << bits, wrap = capacity - 1;
    Buffer tkeys = {0}, tmasks = {0}, zero = {0}, hidden = {0};
    uint64_t *converted = NULL;
    PyObject *runs = NULL;
    if (get_buffer(args[1], &tkeys, (Py_ssize_t)capacity + 1, "table_keys") < 0
        || get_buffer(args[2], &tmasks, ((Py_ssize_t)capacity + 1) * words, "table_masks") < 0
        || get_buffer(args[6], &zero, words, "zero") < 0
        || (args[8] != Py_None && get_buffer(args[8], &hidden, words, "hidden") < 0))
        goto done;
    const uint64_t *table = tkeys.view.buf, *masks = tmasks.view.buf;
    const uint64_t *zero_row = zero.view.buf;
    const uint64_t *hidden_row = hidden.held ? hidden.view.buf : NULL;
    converted = PyMem_Malloc((n ? 2 * n : 1) * sizeof(uint64_t));
    if (converted == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    uint64_t *homes = converted + n;
    unsigned shift = 64 - bits;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key;
        if (PyLong_CheckExact(items[i])) {
            key = PyLong_AsUnsignedLongLong(items[i]);
        } else { /* a numpy integer, a bool, ...: what it stands for as an int */
            PyObject *number = PyNumber_Index(items[i]);
            if (number == NULL)
                goto done;
            key = PyLong_AsUnsignedLongLong(number);
            Py_DECREF(number);
        }
        if (key == (uint64_t)-1 && PyErr_Occurred())
            goto done;
        converted[i] = key;
        homes[i] = (key * multiplier) >> shift;
        if (i < PREFETCH_AHEAD) {
            __builtin_prefetch(&table[homes[i]]);
            __builtin_prefetch(&masks[homes[i] * words]);
        }
    }
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
            uint64_t slot = homes[i], step = 0;
            for (;;) {
                uint64_t found = table[slot];
                if (found == key) {
                    held = &masks[slot * words];
                    break;
                }
                if (found == 0) {
                    held = &masks[capacity * words]; /* the absent row: all zero */
                    break;
                }
                step++;
                slot = (slot + step) & wrap;
            }
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
    release(&tkeys);
    release(&tmasks);
    release(&zero);
    release(&hidden);
    Py_DECREF(seq);
    return runs;
}

static PyMethodDef methods[] = {
    {"leading_runs", (PyCFunction)(void (*)(void))leading_runs, METH_FASTCALL, leading_runs_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvcore.index._probe",
    "A prompt's leading runs read from a KeyTable in one C pass.", -1, methods,
};

PyMODINIT_FUNC
PyInit__probe(void)
{
    return PyModule_Create(&module);
}
