/* C accelerator for the per-row hot path: pgoutput TupleData and COPY text lines to
 * column values, and column values to the event's key and row JSON.
 *
 * Every function here has a pure-Python twin (cdc/pgoutput.py, snapshot/copy_text.py,
 * cdc/events.py) that stays the reference: the twin reports every error, so this code
 * returns None instead of raising on input it does not handle, and the caller runs the
 * twin. tests/test_speedups.py checks both give the same objects and the same bytes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

/* ---------------------------------------------------------------- output buffer */

typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
    char small[4096];
} Buf;

static void buf_init(Buf *b) {
    b->data = b->small;
    b->len = 0;
    b->cap = sizeof(b->small);
}

static void buf_free(Buf *b) {
    if (b->data != b->small) PyMem_Free(b->data);
}

static int buf_reserve(Buf *b, Py_ssize_t extra) {
    if (b->len + extra <= b->cap) return 0;
    Py_ssize_t cap = b->cap * 2;
    while (cap < b->len + extra) cap *= 2;
    char *data;
    if (b->data == b->small) {
        data = PyMem_Malloc(cap);
        if (data != NULL) memcpy(data, b->small, b->len);
    } else {
        data = PyMem_Realloc(b->data, cap);
    }
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

/* A JSON string, escaped exactly as orjson escapes it (the key bytes must not depend on
 * which twin rendered them): quote, backslash and control characters only, the short
 * forms for \b \t \n \f \r, \u00xx in lower case otherwise; UTF-8 passes through. */
static int buf_put_json_string(Buf *b, const char *s, Py_ssize_t n) {
    static const char hex[] = "0123456789abcdef";
    if (buf_reserve(b, n * 6 + 2) < 0) return -1;
    char *p = b->data + b->len;
    *p++ = '"';
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') {
            *p++ = (char)c;
            continue;
        }
        *p++ = '\\';
        switch (c) {
        case '"': *p++ = '"'; break;
        case '\\': *p++ = '\\'; break;
        case '\b': *p++ = 'b'; break;
        case '\t': *p++ = 't'; break;
        case '\n': *p++ = 'n'; break;
        case '\f': *p++ = 'f'; break;
        case '\r': *p++ = 'r'; break;
        default:
            *p++ = 'u';
            *p++ = '0';
            *p++ = '0';
            *p++ = hex[c >> 4];
            *p++ = hex[c & 15];
        }
    }
    *p++ = '"';
    b->len = p - b->data;
    return 0;
}

/* ---------------------------------------------------------------- parse_tuple */

/* parse_tuple(buf, pos, unchanged) -> (values, end) | None
 * pgoutput TupleData at pos: str for 't', None for 'n', `unchanged` for 'u'. */
static PyObject *parse_tuple(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "parse_tuple(buf, pos, unchanged)");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *buf = view.buf;
    Py_ssize_t size = view.len;
    PyObject *out = NULL, *result = NULL;

    if (pos < 0 || pos + 2 > size) goto fallback;
    Py_ssize_t n = (buf[pos] << 8) | buf[pos + 1];
    pos += 2;
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (pos >= size) goto fallback;
        unsigned char kind = buf[pos];
        PyObject *value;
        if (kind == 't') {
            if (pos + 5 > size) goto fallback;
            Py_ssize_t len = ((Py_ssize_t)buf[pos + 1] << 24) | (buf[pos + 2] << 16) | (buf[pos + 3] << 8) | buf[pos + 4];
            pos += 5;
            if (len > size - pos) goto fallback;
            value = PyUnicode_DecodeUTF8((const char *)buf + pos, len, NULL);
            if (value == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto done;
                PyErr_Clear();
                goto fallback;
            }
            pos += len;
        } else if (kind == 'n') {
            value = Py_NewRef(Py_None);
            pos += 1;
        } else if (kind == 'u') {
            value = Py_NewRef(args[2]);
            pos += 1;
        } else {
            goto fallback;  /* 'b' (binary: never requested) or not TupleData at all */
        }
        PyList_SET_ITEM(out, i, value);
    }
    result = Py_BuildValue("(On)", out, pos);
    goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    return result;
}

/* ---------------------------------------------------------------- parse_copy_line */

/* One COPY text field: \N is NULL, backslash escapes resolved, UTF-8 decoded.
 * Returns NULL with no exception set for input the Python twin must judge. */
static PyObject *copy_field(const char *s, Py_ssize_t n, Buf *tmp) {
    if (memchr(s, '\\', n) == NULL) return PyUnicode_DecodeUTF8(s, n, NULL);
    if (n == 2 && s[0] == '\\' && s[1] == 'N') return Py_NewRef(Py_None);
    tmp->len = 0;
    if (buf_reserve(tmp, n) < 0) return NULL;
    char *p = tmp->data;
    for (Py_ssize_t i = 0; i < n; i++) {
        char c = s[i];
        if (c != '\\') {
            *p++ = c;
            continue;
        }
        if (++i == n) return NULL;
        switch (s[i]) {
        case '\\': *p++ = '\\'; break;
        case 't': *p++ = '\t'; break;
        case 'n': *p++ = '\n'; break;
        case 'r': *p++ = '\r'; break;
        case 'b': *p++ = '\b'; break;
        case 'f': *p++ = '\f'; break;
        case 'v': *p++ = '\v'; break;
        default: return NULL;
        }
    }
    return PyUnicode_DecodeUTF8(tmp->data, p - tmp->data, NULL);
}

/* parse_copy_line(line) -> list | None: one COPY text line, None for NULL fields. */
static PyObject *parse_copy_line(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const char *s = view.buf;
    Py_ssize_t n = view.len;
    if (n > 0 && s[n - 1] == '\n') n--;
    PyObject *out = PyList_New(0);
    Buf tmp;
    buf_init(&tmp);
    if (out == NULL) goto error;
    Py_ssize_t start = 0;
    for (;;) {
        const char *tab = memchr(s + start, '\t', n - start);
        Py_ssize_t end = tab == NULL ? n : tab - s;
        PyObject *value = copy_field(s + start, end - start, &tmp);
        if (value == NULL) {
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto error;
            PyErr_Clear();
            Py_DECREF(out);
            out = Py_NewRef(Py_None);
            break;
        }
        int failed = PyList_Append(out, value);
        Py_DECREF(value);
        if (failed) goto error;
        if (tab == NULL) break;
        start = end + 1;
    }
    buf_free(&tmp);
    PyBuffer_Release(&view);
    return out;
error:
    Py_XDECREF(out);
    buf_free(&tmp);
    PyBuffer_Release(&view);
    return NULL;
}

/* ---------------------------------------------------------------- RowEncoder */

enum { KIND_CALL = 0, KIND_INT = 1, KIND_STRING = 2, KIND_BOOL = 3, KIND_TIMESTAMPTZ = 4 };

typedef struct {
    PyObject_HEAD
    Py_ssize_t ncols;
    PyObject *names;      /* tuple of bytes: '"name":' as JSON, one per column */
    PyObject *kinds;      /* bytes: one KIND_* per column */
    PyObject *converters; /* tuple: the Python converter of each column (KIND_CALL and edge cases) */
    PyObject *key_indexes;
    Py_ssize_t nkeys;
    Py_ssize_t *keys;
    PyObject *dumps;      /* orjson.dumps */
    PyObject *unchanged;  /* pgoutput.UNCHANGED */
} RowEncoder;

static void RowEncoder_dealloc(RowEncoder *self) {
    Py_XDECREF(self->names);
    Py_XDECREF(self->kinds);
    Py_XDECREF(self->converters);
    Py_XDECREF(self->key_indexes);
    Py_XDECREF(self->dumps);
    Py_XDECREF(self->unchanged);
    PyMem_Free(self->keys);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int RowEncoder_init(RowEncoder *self, PyObject *args, PyObject *kwds) {
    PyObject *names, *kinds, *converters, *key_indexes, *dumps, *unchanged;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OO", &PyTuple_Type, &names, &PyBytes_Type, &kinds, &PyTuple_Type,
                          &converters, &PyTuple_Type, &key_indexes, &dumps, &unchanged))
        return -1;
    Py_ssize_t ncols = PyTuple_GET_SIZE(names);
    if (PyBytes_GET_SIZE(kinds) != ncols || PyTuple_GET_SIZE(converters) != ncols) {
        PyErr_SetString(PyExc_ValueError, "names, kinds and converters differ in length");
        return -1;
    }
    for (Py_ssize_t i = 0; i < ncols; i++) {
        if (!PyBytes_Check(PyTuple_GET_ITEM(names, i))) {
            PyErr_SetString(PyExc_TypeError, "names must be bytes");
            return -1;
        }
    }
    Py_ssize_t nkeys = PyTuple_GET_SIZE(key_indexes);
    Py_ssize_t *keys = PyMem_Malloc(sizeof(Py_ssize_t) * (nkeys ? nkeys : 1));
    if (keys == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < nkeys; k++) {
        keys[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(key_indexes, k));
        if (keys[k] < 0 || keys[k] >= ncols) {
            PyMem_Free(keys);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "key index out of range");
            return -1;
        }
    }
    PyMem_Free(self->keys);
    self->keys = keys;
    self->nkeys = nkeys;
    self->ncols = ncols;
    Py_XSETREF(self->names, Py_NewRef(names));
    Py_XSETREF(self->kinds, Py_NewRef(kinds));
    Py_XSETREF(self->converters, Py_NewRef(converters));
    Py_XSETREF(self->key_indexes, Py_NewRef(key_indexes));
    Py_XSETREF(self->dumps, Py_NewRef(dumps));
    Py_XSETREF(self->unchanged, Py_NewRef(unchanged));
    return 0;
}

static int is_json_integer(const char *s, Py_ssize_t n) {
    Py_ssize_t i = (n > 0 && s[0] == '-') ? 1 : 0;
    if (i == n) return 0;
    if (s[i] == '0' && n - i > 1) return 0;
    for (; i < n; i++)
        if (s[i] < '0' || s[i] > '9') return 0;
    return 1;
}

/* The Python converter, then orjson: the general case, correct for every type. */
static int put_converted(RowEncoder *self, Buf *b, Py_ssize_t i, PyObject *value) {
    PyObject *converted = PyObject_CallOneArg(PyTuple_GET_ITEM(self->converters, i), value);
    if (converted == NULL) return -1;
    PyObject *json = PyObject_CallOneArg(self->dumps, converted);
    Py_DECREF(converted);
    if (json == NULL) return -1;
    int rc = buf_put(b, PyBytes_AS_STRING(json), PyBytes_GET_SIZE(json));
    Py_DECREF(json);
    return rc;
}

/* encode(values) -> (key, row) | None
 * The key JSON (key columns in key order) and the row JSON (every column) of one row of
 * text values; None when a value is UNCHANGED or not text (the Python twin fills those). */
static PyObject *RowEncoder_encode(RowEncoder *self, PyObject *values) {
    if (!PyList_CheckExact(values) || PyList_GET_SIZE(values) != self->ncols) {
        PyErr_Format(PyExc_ValueError, "expected a list of %zd column values", self->ncols);
        return NULL;
    }
    Buf row;
    buf_init(&row);
    Py_ssize_t starts[64], ends[64];
    Py_ssize_t *start = starts, *end = ends;
    PyObject *result = NULL;
    if (self->ncols > 64) {
        start = PyMem_Malloc(sizeof(Py_ssize_t) * self->ncols * 2);
        if (start == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
        end = start + self->ncols;
    }
    const char *kinds = PyBytes_AS_STRING(self->kinds);
    if (buf_put(&row, "{", 1) < 0) goto done;
    for (Py_ssize_t i = 0; i < self->ncols; i++) {
        PyObject *name = PyTuple_GET_ITEM(self->names, i);
        if (i > 0 && buf_put(&row, ",", 1) < 0) goto done;
        if (buf_put(&row, PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name)) < 0) goto done;
        start[i] = row.len;
        PyObject *value = PyList_GET_ITEM(values, i);
        if (value == Py_None) {
            if (buf_put(&row, "null", 4) < 0) goto done;
            end[i] = row.len;
            continue;
        }
        if (!PyUnicode_CheckExact(value)) {  /* UNCHANGED, or binary: the twin's business */
            result = Py_NewRef(Py_None);
            goto done;
        }
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(value, &n);
        if (s == NULL) goto done;
        int rc;
        switch (kinds[i]) {
        case KIND_INT:
            rc = is_json_integer(s, n) ? buf_put(&row, s, n) : put_converted(self, &row, i, value);
            break;
        case KIND_STRING:
            rc = buf_put_json_string(&row, s, n);
            break;
        case KIND_BOOL:
            if (n == 1 && s[0] == 't')
                rc = buf_put(&row, "true", 4);
            else if (n == 1 && s[0] == 'f')
                rc = buf_put(&row, "false", 5);
            else
                rc = put_converted(self, &row, i, value);
            break;
        case KIND_TIMESTAMPTZ:
            /* '2024-01-02 03:04:05.12+00' -> "2024-01-02T03:04:05.12Z" (UTC session, AD,
             * four-digit year: the twin's fast case; every other form goes to the twin). */
            if (n >= 22 && s[4] == '-' && s[10] == ' ' && s[n - 3] == '+' && s[n - 2] == '0' && s[n - 1] == '0') {
                if ((rc = buf_reserve(&row, n + 1)) == 0) {
                    char *p = row.data + row.len;
                    *p++ = '"';
                    memcpy(p, s, 10);
                    p[10] = 'T';
                    memcpy(p + 11, s + 11, n - 14);
                    p += n - 3;
                    *p++ = 'Z';
                    *p++ = '"';
                    row.len = p - row.data;
                }
            } else {
                rc = put_converted(self, &row, i, value);
            }
            break;
        default:
            rc = put_converted(self, &row, i, value);
        }
        if (rc < 0) goto done;
        end[i] = row.len;
    }
    if (buf_put(&row, "}", 1) < 0) goto done;

    Py_ssize_t key_len = 2;
    for (Py_ssize_t k = 0; k < self->nkeys; k++) {
        Py_ssize_t i = self->keys[k];
        key_len += 1 + PyBytes_GET_SIZE(PyTuple_GET_ITEM(self->names, i)) + end[i] - start[i];
    }
    PyObject *key = PyBytes_FromStringAndSize(NULL, key_len - (self->nkeys ? 1 : 0));
    if (key == NULL) goto done;
    char *p = PyBytes_AS_STRING(key);
    *p++ = '{';
    for (Py_ssize_t k = 0; k < self->nkeys; k++) {
        Py_ssize_t i = self->keys[k];
        PyObject *name = PyTuple_GET_ITEM(self->names, i);
        if (k > 0) *p++ = ',';
        memcpy(p, PyBytes_AS_STRING(name), PyBytes_GET_SIZE(name));
        p += PyBytes_GET_SIZE(name);
        memcpy(p, row.data + start[i], end[i] - start[i]);
        p += end[i] - start[i];
    }
    *p++ = '}';
    PyObject *value = PyBytes_FromStringAndSize(row.data, row.len);
    if (value == NULL) {
        Py_DECREF(key);
        goto done;
    }
    result = PyTuple_Pack(2, key, value);
    Py_DECREF(key);
    Py_DECREF(value);
done:
    if (start != starts) PyMem_Free(start);
    buf_free(&row);
    return result;
}

static PyMethodDef RowEncoder_methods[] = {
    {"encode", (PyCFunction)RowEncoder_encode, METH_O,
     "encode(values) -> (key, row) | None: the key and row JSON of one row of text values."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RowEncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cdc._speedups.RowEncoder",
    .tp_basicsize = sizeof(RowEncoder),
    .tp_dealloc = (destructor)RowEncoder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RowEncoder(names, kinds, converters, key_indexes, dumps, unchanged)",
    .tp_methods = RowEncoder_methods,
    .tp_init = (initproc)RowEncoder_init,
    .tp_new = PyType_GenericNew,
};

/* ---------------------------------------------------------------- envelope */

static void put_piece(char **p, PyObject *piece) {
    if (piece == Py_None) {
        memcpy(*p, "null", 4);
        *p += 4;
    } else {
        memcpy(*p, PyBytes_AS_STRING(piece), PyBytes_GET_SIZE(piece));
        *p += PyBytes_GET_SIZE(piece);
    }
}

/* envelope(before, after, source, op) -> bytes: the Debezium envelope around ready JSON
 * pieces (before/after: bytes or None), stamped with the current time as
 * cdc/events.py's twin does. */
static PyObject *envelope(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "envelope(before, after, source, op)");
        return NULL;
    }
    for (int i = 0; i < 4; i++) {
        if (args[i] != Py_None && !PyBytes_CheckExact(args[i])) {
            PyErr_SetString(PyExc_TypeError, "envelope pieces must be bytes or None");
            return NULL;
        }
    }
    if (args[2] == Py_None || args[3] == Py_None) {
        PyErr_SetString(PyExc_TypeError, "envelope needs a source and an op");
        return NULL;
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    long long us = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
    char ms_s[24], us_s[24];
    int ms_n = snprintf(ms_s, sizeof ms_s, "%lld", us / 1000), us_n = snprintf(us_s, sizeof us_s, "%lld", us);
    static const char h1[] = "{\"before\":", h2[] = ",\"after\":", h3[] = ",\"source\":",
                      h4[] = ",\"transaction\":null,\"op\":", h5[] = ",\"ts_ms\":", h6[] = ",\"ts_us\":",
                      h7[] = ",\"ts_ns\":", h8[] = "000}";
    Py_ssize_t len = sizeof h1 + sizeof h2 + sizeof h3 + sizeof h4 + sizeof h5 + sizeof h6 + sizeof h7 + sizeof h8 - 8;
    for (int i = 0; i < 4; i++) len += args[i] == Py_None ? 4 : PyBytes_GET_SIZE(args[i]);
    len += ms_n + 2 * us_n;
    PyObject *out = PyBytes_FromStringAndSize(NULL, len);
    if (out == NULL) return NULL;
    char *p = PyBytes_AS_STRING(out);
#define PUT(lit) (memcpy(p, lit, sizeof lit - 1), p += sizeof lit - 1)
    PUT(h1);
    put_piece(&p, args[0]);
    PUT(h2);
    put_piece(&p, args[1]);
    PUT(h3);
    put_piece(&p, args[2]);
    PUT(h4);
    put_piece(&p, args[3]);
    PUT(h5);
    memcpy(p, ms_s, ms_n), p += ms_n;
    PUT(h6);
    memcpy(p, us_s, us_n), p += us_n;
    PUT(h7);
    memcpy(p, us_s, us_n), p += us_n;
    PUT(h8);
#undef PUT
    return out;
}

/* ---------------------------------------------------------------- partition_for */

/* partition_for(key, partitions) -> int: Kafka's default partitioner (cdc/partitioner.py). */
static PyObject *partition_for(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "partition_for(key, partitions)");
        return NULL;
    }
    long partitions = PyLong_AsLong(args[1]);
    if (partitions == -1 && PyErr_Occurred()) return NULL;
    if (partitions <= 0) {
        PyErr_Format(PyExc_ValueError, "partition count must be positive, got %ld", partitions);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *data = view.buf;
    uint32_t n = (uint32_t)view.len, m = 0x5bd1e995, h = 0x9747b28c ^ n;
    for (uint32_t i = 0; i + 4 <= n; i += 4) {
        uint32_t k = data[i] | (data[i + 1] << 8) | (data[i + 2] << 16) | ((uint32_t)data[i + 3] << 24);
        k *= m;
        k ^= k >> 24;
        k *= m;
        h *= m;
        h ^= k;
    }
    uint32_t tail = n & ~3u;
    switch (n & 3) {
    case 3: h ^= (uint32_t)data[tail + 2] << 16; /* fall through */
    case 2: h ^= (uint32_t)data[tail + 1] << 8; /* fall through */
    case 1: h ^= data[tail]; h *= m;
    }
    h ^= h >> 13;
    h *= m;
    h ^= h >> 15;
    PyBuffer_Release(&view);
    return PyLong_FromLong((long)((h & 0x7fffffff) % (uint32_t)partitions));
}

/* ---------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"parse_tuple", (PyCFunction)(void (*)(void))parse_tuple, METH_FASTCALL,
     "parse_tuple(buf, pos, unchanged) -> (values, end) | None"},
    {"parse_copy_line", parse_copy_line, METH_O, "parse_copy_line(line) -> list | None"},
    {"envelope", (PyCFunction)(void (*)(void))envelope, METH_FASTCALL,
     "envelope(before, after, source, op) -> bytes: the Debezium envelope, stamped now"},
    {"partition_for", (PyCFunction)(void (*)(void))partition_for, METH_FASTCALL,
     "partition_for(key, partitions) -> int: Kafka's default partitioner"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cdc._speedups", "C twins of the per-row hot path (see cdc/fastpath.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    if (PyType_Ready(&RowEncoderType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "RowEncoder", (PyObject *)&RowEncoderType) < 0 ||
        PyModule_AddIntConstant(m, "KIND_CALL", KIND_CALL) < 0 || PyModule_AddIntConstant(m, "KIND_INT", KIND_INT) < 0 ||
        PyModule_AddIntConstant(m, "KIND_STRING", KIND_STRING) < 0 ||
        PyModule_AddIntConstant(m, "KIND_BOOL", KIND_BOOL) < 0 ||
        PyModule_AddIntConstant(m, "KIND_TIMESTAMPTZ", KIND_TIMESTAMPTZ) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
