/* C accelerator for the per-row hot path: pgoutput TupleData and COPY text lines to
 * column values, and column values to the event's key and row JSON.
 *
 * Every function here has a pure-Python twin (cdc/source/pgoutput.py, snapshot/copy_text.py,
 * cdc/events/records.py) that stays the reference: the twin reports every error, so this code
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

/* TupleData at *pos into a new list (str for 't', None for 'n', `unchanged` for 'u');
 * *pos moves past it. 1: done; 0: left to the Python twin (binary, malformed); -1: error. */
static int read_tuple(const unsigned char *buf, Py_ssize_t size, Py_ssize_t *at, PyObject *unchanged,
                      PyObject **values) {
    Py_ssize_t pos = *at;
    *values = NULL;
    if (pos < 0 || pos + 2 > size) return 0;
    Py_ssize_t n = (buf[pos] << 8) | buf[pos + 1];
    pos += 2;
    PyObject *out = PyList_New(n);
    if (out == NULL) return -1;
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
                if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
                    Py_DECREF(out);
                    return -1;
                }
                PyErr_Clear();
                goto fallback;
            }
            pos += len;
        } else if (kind == 'n') {
            value = Py_NewRef(Py_None);
            pos += 1;
        } else if (kind == 'u') {
            value = Py_NewRef(unchanged);
            pos += 1;
        } else {
            goto fallback;  /* 'b' (binary: never requested) or not TupleData at all */
        }
        PyList_SET_ITEM(out, i, value);
    }
    *values = out;
    *at = pos;
    return 1;
fallback:
    Py_DECREF(out);
    return 0;
}

/* parse_tuple(buf, pos, unchanged) -> (values, end) | None: pgoutput TupleData at pos. */
static PyObject *parse_tuple(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "parse_tuple(buf, pos, unchanged)");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *values, *result = NULL;
    int rc = read_tuple(view.buf, view.len, &pos, args[2], &values);
    if (rc > 0) {
        result = Py_BuildValue("(Nn)", values, pos);
    } else if (rc == 0) {
        result = Py_NewRef(Py_None);
    }
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
    /* render_change only: what a record needs besides key and value */
    PyObject *topic;        /* str */
    PyObject *table;        /* str: schema.table */
    PyObject *record;       /* the Record type (a tuple subclass) */
    PyObject *source_parts; /* txn -> (head, tail) of the `source` block, see cdc/events/records.py */
    PyObject *txn_key;      /* (commit_lsn, commit_ts_us, xid) of the transaction whose head and tail are cached */
    PyObject *head;
    PyObject *tail;
} RowEncoder;

/* Every object a RowEncoder holds, for the cycle collector: its source_parts callable
 * usually belongs to the TableEvents that holds the encoder. */
#define ROW_ENCODER_FIELDS(X)                                                                              \
    X(names) X(kinds) X(converters) X(key_indexes) X(dumps) X(unchanged) X(topic) X(table) X(record)        \
    X(source_parts) X(txn_key) X(head) X(tail)

static int RowEncoder_traverse(RowEncoder *self, visitproc visit, void *arg) {
#define VISIT(f) Py_VISIT(self->f);
    ROW_ENCODER_FIELDS(VISIT)
#undef VISIT
    return 0;
}

static int RowEncoder_clear(RowEncoder *self) {
#define CLEAR(f) Py_CLEAR(self->f);
    ROW_ENCODER_FIELDS(CLEAR)
#undef CLEAR
    return 0;
}

static void RowEncoder_dealloc(RowEncoder *self) {
    PyObject_GC_UnTrack(self);
    RowEncoder_clear(self);
    PyMem_Free(self->keys);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int RowEncoder_init(RowEncoder *self, PyObject *args, PyObject *kwds) {
    PyObject *names, *kinds, *converters, *key_indexes, *dumps, *unchanged;
    PyObject *topic = NULL, *table = NULL, *record = NULL, *source_parts = NULL;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OO|O!O!O!O", &PyTuple_Type, &names, &PyBytes_Type, &kinds, &PyTuple_Type,
                          &converters, &PyTuple_Type, &key_indexes, &dumps, &unchanged, &PyUnicode_Type, &topic,
                          &PyUnicode_Type, &table, &PyType_Type, &record, &source_parts))
        return -1;
    if (record != NULL && !PyType_IsSubtype((PyTypeObject *)record, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "record must be a tuple subclass");
        return -1;
    }
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
    Py_XSETREF(self->topic, Py_XNewRef(topic));
    Py_XSETREF(self->table, Py_XNewRef(table));
    Py_XSETREF(self->record, Py_XNewRef(record));
    Py_XSETREF(self->source_parts, Py_XNewRef(source_parts));
    Py_CLEAR(self->txn_key);
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

/* Whether JSON needs no escape inside these bytes (no quote, backslash or control character). */
static int json_plain(const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (s[i] == '"' || s[i] == '\\' || (unsigned char)s[i] < 0x20) return 0;
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

/* The key JSON (key columns in key order) and the row JSON (every column) of one row of
 * text values into *key_out and *row_out. 1: done; 0: a value is UNCHANGED or not text
 * (the Python twin fills those); -1: error. */
static int encode_row(RowEncoder *self, PyObject *values, PyObject **key_out, PyObject **row_out) {
    if (!PyList_CheckExact(values) || PyList_GET_SIZE(values) != self->ncols) {
        PyErr_Format(PyExc_ValueError, "expected a list of %zd column values", self->ncols);
        return -1;
    }
    Buf row;
    buf_init(&row);
    Py_ssize_t starts[64], ends[64];
    Py_ssize_t *start = starts, *end = ends;
    int result = -1;
    if (self->ncols > 64) {
        start = PyMem_Malloc(sizeof(Py_ssize_t) * self->ncols * 2);
        if (start == NULL) {
            PyErr_NoMemory();
            return -1;
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
            result = 0;
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
             * four-digit year: the twin's fast case; every other form goes to the twin, and so
             * does text that would need a JSON escape, which PostgreSQL never sends). */
            if (n >= 22 && s[4] == '-' && s[10] == ' ' && s[n - 3] == '+' && s[n - 2] == '0' && s[n - 1] == '0'
                && json_plain(s, n)) {
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
    *key_out = key;
    *row_out = value;
    result = 1;
done:
    if (start != starts) PyMem_Free(start);
    buf_free(&row);
    return result;
}

/* encode(values) -> (key, row) | None */
static PyObject *RowEncoder_encode(RowEncoder *self, PyObject *values) {
    PyObject *key, *row;
    int rc = encode_row(self, values, &key, &row);
    if (rc < 0) return NULL;
    if (rc == 0) Py_RETURN_NONE;
    PyObject *out = PyTuple_Pack(2, key, row);
    Py_DECREF(key);
    Py_DECREF(row);
    return out;
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
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "RowEncoder(names, kinds, converters, key_indexes, dumps, unchanged[, topic, table, record, source_parts])",
    .tp_traverse = (traverseproc)RowEncoder_traverse,
    .tp_clear = (inquiry)RowEncoder_clear,
    .tp_methods = RowEncoder_methods,
    .tp_init = (initproc)RowEncoder_init,
    .tp_new = PyType_GenericNew,
};

/* ---------------------------------------------------------------- envelope */

/* The Debezium envelope around ready JSON pieces (before/after: bytes, or NULL or None for
 * null), stamped with the current time as cdc/events/records.py's twin does. */
static PyObject *make_envelope(PyObject *before, PyObject *after, PyObject *source, PyObject *op) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    long long us = (long long)now.tv_sec * 1000000 + now.tv_nsec / 1000;
    char ms_s[24], us_s[24];
    int ms_n = snprintf(ms_s, sizeof ms_s, "%lld", us / 1000), us_n = snprintf(us_s, sizeof us_s, "%lld", us);
    static const char h1[] = "{\"before\":", h2[] = ",\"after\":", h3[] = ",\"source\":",
                      h4[] = ",\"transaction\":null,\"op\":", h5[] = ",\"ts_ms\":", h6[] = ",\"ts_us\":",
                      h7[] = ",\"ts_ns\":", h8[] = "000}";
    if (before == Py_None) before = NULL;
    if (after == Py_None) after = NULL;
    Py_ssize_t len = sizeof h1 + sizeof h2 + sizeof h3 + sizeof h4 + sizeof h5 + sizeof h6 + sizeof h7 + sizeof h8 - 8;
    len += (before ? PyBytes_GET_SIZE(before) : 4) + (after ? PyBytes_GET_SIZE(after) : 4);
    len += PyBytes_GET_SIZE(source) + PyBytes_GET_SIZE(op) + ms_n + 2 * us_n;
    PyObject *out = PyBytes_FromStringAndSize(NULL, len);
    if (out == NULL) return NULL;
    char *p = PyBytes_AS_STRING(out);
#define PUT(lit) (memcpy(p, lit, sizeof lit - 1), p += sizeof lit - 1)
#define PUT_BYTES(obj) (memcpy(p, PyBytes_AS_STRING(obj), PyBytes_GET_SIZE(obj)), p += PyBytes_GET_SIZE(obj))
    PUT(h1);
    if (before) PUT_BYTES(before); else PUT("null");
    PUT(h2);
    if (after) PUT_BYTES(after); else PUT("null");
    PUT(h3);
    PUT_BYTES(source);
    PUT(h4);
    PUT_BYTES(op);
    PUT(h5);
    memcpy(p, ms_s, ms_n), p += ms_n;
    PUT(h6);
    memcpy(p, us_s, us_n), p += us_n;
    PUT(h7);
    memcpy(p, us_s, us_n), p += us_n;
    PUT(h8);
#undef PUT
#undef PUT_BYTES
    return out;
}

/* envelope(before, after, source, op) -> bytes */
static PyObject *envelope(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "envelope(before, after, source, op)");
        return NULL;
    }
    for (int i = 0; i < 4; i++) {
        if (args[i] == Py_None ? i >= 2 : !PyBytes_CheckExact(args[i])) {
            PyErr_SetString(PyExc_TypeError, "envelope: before and after are bytes or None, source and op bytes");
            return NULL;
        }
    }
    return make_envelope(args[0], args[1], args[2], args[3]);
}

/* ---------------------------------------------------------------- render_change */

static PyObject *OP_C, *OP_U, *OP_D; /* b'"c"', b'"u"', b'"d"' */
static PyObject *TXN_FIELDS[3];      /* 'commit_lsn', 'commit_ts_us', 'xid': a Txn's, its source block's key */

/* Cache the head and tail of `txn`'s source block unless they are cached already. The cache
 * knows the transaction by its values, not by holding the Txn: a wide schema's encoders would
 * each keep the Txn of their table's last change alive until the table's next one, long
 * enough to pass the collector's young passes, and a Txn promoted to the oldest generation
 * for every change made its full passes frequent (docs/benchmarks.md). */
static int cache_txn(RowEncoder *self, PyObject *txn) {
    PyObject *values[3] = {NULL, NULL, NULL};
    int same = self->txn_key != NULL, ok = -1;
    for (int i = 0; i < 3; i++) {
        if ((values[i] = PyObject_GetAttr(txn, TXN_FIELDS[i])) == NULL) goto done;
        if (same && (same = PyObject_RichCompareBool(values[i], PyTuple_GET_ITEM(self->txn_key, i), Py_EQ)) < 0)
            goto done;
    }
    if (!same) {
        PyObject *parts = PyObject_CallOneArg(self->source_parts, txn);
        if (parts == NULL) goto done;
        if (!PyTuple_CheckExact(parts) || PyTuple_GET_SIZE(parts) != 2 || !PyBytes_CheckExact(PyTuple_GET_ITEM(parts, 0)) ||
            !PyBytes_CheckExact(PyTuple_GET_ITEM(parts, 1))) {
            Py_DECREF(parts);
            PyErr_SetString(PyExc_TypeError, "source_parts must return (head, tail) as bytes");
            goto done;
        }
        PyObject *key = PyTuple_Pack(3, values[0], values[1], values[2]);
        if (key == NULL) {
            Py_DECREF(parts);
            goto done;
        }
        Py_XSETREF(self->head, Py_NewRef(PyTuple_GET_ITEM(parts, 0)));
        Py_XSETREF(self->tail, Py_NewRef(PyTuple_GET_ITEM(parts, 1)));
        Py_DECREF(parts);
        if (PyLong_CheckExact(values[0]) && PyLong_CheckExact(values[1]) && (values[2] == Py_None || PyLong_CheckExact(values[2])))
            PyObject_GC_UnTrack(key); /* ints and None: no cycle through it, nothing for the collector to walk */
        Py_XSETREF(self->txn_key, key);
    }
    ok = 0;
done:
    for (int i = 0; i < 3; i++) Py_XDECREF(values[i]);
    return ok;
}

/* The `source` block of a streamed change: the transaction's cached head and tail around
 * the change LSN (the twin: TableEvents.source). */
static PyObject *change_source(RowEncoder *self, PyObject *txn, unsigned long long change_lsn) {
    if (cache_txn(self, txn) < 0) return NULL;
    char lsn_s[24];
    int lsn_n = snprintf(lsn_s, sizeof lsn_s, "%llu", change_lsn);
    static const char mid[] = "\\\"]\"", end[] = ",\"xmin\":null}";
    Py_ssize_t hn = PyBytes_GET_SIZE(self->head), tn = PyBytes_GET_SIZE(self->tail);
    PyObject *out = PyBytes_FromStringAndSize(NULL, hn + 2 * lsn_n + tn + sizeof mid - 1 + sizeof end - 1);
    if (out == NULL) return NULL;
    char *p = PyBytes_AS_STRING(out);
    memcpy(p, PyBytes_AS_STRING(self->head), hn), p += hn;
    memcpy(p, lsn_s, lsn_n), p += lsn_n;
    memcpy(p, mid, sizeof mid - 1), p += sizeof mid - 1;
    memcpy(p, PyBytes_AS_STRING(self->tail), tn), p += tn;
    memcpy(p, lsn_s, lsn_n), p += lsn_n;
    memcpy(p, end, sizeof end - 1);
    return out;
}

/* Append Record(topic, key, value, table) to `out`; value NULL is a tombstone. */
static int add_record(RowEncoder *self, PyObject *out, PyObject *key, PyObject *value) {
    PyObject *fields = PyTuple_Pack(4, self->topic, key, value ? value : Py_None, self->table);
    if (fields == NULL) return -1;
    PyObject *args = PyTuple_Pack(1, fields);
    Py_DECREF(fields);
    if (args == NULL) return -1;
    PyObject *record = PyTuple_Type.tp_new((PyTypeObject *)self->record, args, NULL);
    Py_DECREF(args);
    if (record == NULL) return -1;
    int rc = PyList_Append(out, record);
    Py_DECREF(record);
    return rc;
}

/* An event record: the envelope of (before, after) under `op`, appended to `out`. */
static int add_event(RowEncoder *self, PyObject *out, PyObject *key, PyObject *op, PyObject *before, PyObject *after,
                     PyObject *source) {
    PyObject *value = make_envelope(before, after, source, op);
    if (value == NULL) return -1;
    int rc = add_record(self, out, key, value);
    Py_DECREF(value);
    return rc;
}

/* render_change(c_encoders, message, txn) -> list[Record] | None
 * The records of one XLogData message (the 'w' CopyData message: start LSN, WAL end and
 * clock, then the pgoutput payload) carrying an Insert, Update or Delete outside a stream
 * block, for a relation in `c_encoders` (oid -> RowEncoder), exactly as cdc/events/changes.py renders
 * them at the message's start LSN; None for every other message and whatever the Python
 * path must judge (unknown relation, unchanged TOASTed values, malformed input). */
static PyObject *render_change(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyDict_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "render_change(c_encoders: dict, message, txn)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *result = NULL, *out = NULL, *source = NULL;
    PyObject *old = NULL, *new = NULL, *old_key = NULL, *old_row = NULL, *key = NULL, *row = NULL;
    RowEncoder *self = NULL;
    if (view.len < 25 + 7 || ((const char *)view.buf)[0] != 'w') goto fallback;
    const unsigned char *buf = (const unsigned char *)view.buf + 25, *head = (const unsigned char *)view.buf + 1;
    unsigned long long change_lsn = 0;
    for (int i = 0; i < 8; i++) change_lsn = (change_lsn << 8) | head[i];
    Py_ssize_t size = view.len - 25, pos = 6;
    char kind = (char)buf[0];
    if (kind != 'I' && kind != 'U' && kind != 'D') goto fallback;
    PyObject *oid = PyLong_FromUnsignedLong(((unsigned long)buf[1] << 24) | (buf[2] << 16) | (buf[3] << 8) | buf[4]);
    if (oid == NULL) goto done;
    self = (RowEncoder *)PyDict_GetItemWithError(args[0], oid);
    Py_DECREF(oid);
    if (self == NULL) {
        if (PyErr_Occurred()) goto done;
        goto fallback;
    }
    if (!Py_IS_TYPE(self, &RowEncoderType) || self->record == NULL) {
        PyErr_SetString(PyExc_TypeError, "c_encoders must map relation oids to RowEncoders made with topic, table, record");
        self = NULL;
        goto done;
    }
    Py_INCREF(self); /* converters run Python code: keep the c_encoder alive whatever they do */
    char tag = (char)buf[5];
    int rc;
    if (kind == 'I' || (kind == 'U' && tag == 'N')) {
        if (tag != 'N') goto fallback;
    } else {
        if (tag != 'K' && tag != 'O') goto fallback;
        if ((rc = read_tuple(buf, size, &pos, self->unchanged, &old)) <= 0) goto fail;
        if (kind == 'U') {
            if (pos >= size || buf[pos] != 'N') goto fallback;
            pos++;
        }
    }
    if (kind != 'D' && (rc = read_tuple(buf, size, &pos, self->unchanged, &new)) <= 0) goto fail;
    if (pos != size) goto fallback;
    if (new != NULL && (rc = encode_row(self, new, &key, &row)) <= 0) goto fail;
    if (old != NULL && (rc = encode_row(self, old, &old_key, &old_row)) <= 0) goto fail;
    if ((source = change_source(self, args[2], change_lsn)) == NULL) goto done;
    if ((out = PyList_New(0)) == NULL) goto done;
    if (kind == 'I') {
        if (add_event(self, out, key, OP_C, NULL, row, source) < 0) goto done;
    } else if (kind == 'D') {
        if (add_event(self, out, old_key, OP_D, old_row, NULL, source) < 0) goto done;
        if (add_record(self, out, old_key, NULL) < 0) goto done;
    } else if (old_key != NULL && (PyBytes_GET_SIZE(old_key) != PyBytes_GET_SIZE(key) ||
                                   memcmp(PyBytes_AS_STRING(old_key), PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key)))) {
        /* a key change: the old key must disappear from the compacted topic */
        if (add_event(self, out, old_key, OP_D, old_row, NULL, source) < 0) goto done;
        if (add_record(self, out, old_key, NULL) < 0) goto done;
        if (add_event(self, out, key, OP_C, NULL, row, source) < 0) goto done;
    } else {
        if (add_event(self, out, key, OP_U, tag == 'O' ? old_row : NULL, row, source) < 0) goto done;
    }
    result = Py_NewRef(out);
    goto done;
fail:
    if (rc < 0) goto done;
fallback:
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(out);
    Py_XDECREF(source);
    Py_XDECREF(old);
    Py_XDECREF(new);
    Py_XDECREF(old_key);
    Py_XDECREF(old_row);
    Py_XDECREF(key);
    Py_XDECREF(row);
    Py_XDECREF(self);
    PyBuffer_Release(&view);
    return result;
}

/* ---------------------------------------------------------------- partition_for */

/* partition_for(key, partitions) -> int: Kafka's default partitioner (cdc/kafka/partitioner.py). */
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
    {"render_change", (PyCFunction)(void (*)(void))render_change, METH_FASTCALL,
     "render_change(c_encoders, message, txn) -> list[Record] | None: one XLogData message's records"},
    {"envelope", (PyCFunction)(void (*)(void))envelope, METH_FASTCALL,
     "envelope(before, after, source, op) -> bytes: the Debezium envelope, stamped now"},
    {"partition_for", (PyCFunction)(void (*)(void))partition_for, METH_FASTCALL,
     "partition_for(key, partitions) -> int: Kafka's default partitioner"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cdc._speedups", "C twins of the per-row hot path (see cdc/accel.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    if (PyType_Ready(&RowEncoderType) < 0) return NULL;
    if ((OP_C = PyBytes_FromString("\"c\"")) == NULL || (OP_U = PyBytes_FromString("\"u\"")) == NULL ||
        (OP_D = PyBytes_FromString("\"d\"")) == NULL)
        return NULL;
    static const char *fields[3] = {"commit_lsn", "commit_ts_us", "xid"};
    for (int i = 0; i < 3; i++)
        if ((TXN_FIELDS[i] = PyUnicode_InternFromString(fields[i])) == NULL) return NULL;
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
