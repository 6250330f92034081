"""MaxText's ``dataset_type: grain`` files: documents from ArrayRecord, Parquet or TFRecord.

``grain_train_files`` (and ``grain_eval_files``) is a local glob, or a mixture
``"glob,weight;glob,weight"`` (weights are normalised); ``grain_train_mixture_config_path``
names the sources in a JSON file instead: ``{"name": {"path": glob, "weight": w}, ...}``.
Each glob's files are read in sorted order.

Records (ArrayRecord, TFRecord) are serialised ``tf.train.Example`` protos, as MaxText's
datasets hold them, decoded here without TensorFlow (the message classes are built at run
time from a descriptor that is wire-compatible with TensorFlow's); a record may also be a JSON
object or plain UTF-8 text (the whole record is the document). The document is the record's
``field`` feature (a ``bytes_list``; its first value). Parquet files give the ``field`` column.
With MaxText's ``tokenize_train_data: false`` the field holds token ids instead: an
``int64_list`` feature, a list-of-integers parquet column or JSON list (:func:`read_ids`).

A mixture draws documents from its sources by weight (Megatron's greedy blending order), as
many as all sources hold together; each source is walked in a seeded order that is drawn
again every time the source is used up, so a source with a large weight repeats its
documents, as grain's repeated sources do.
"""
from __future__ import annotations

import functools
import glob
import json
import os
import struct

import numpy as np

from jaxtrain.config.errors import ConfigError
from jaxtrain.data.gpt_dataset import blending_indices, normalize

FILE_TYPES = ("arrayrecord", "parquet", "tfrecord")
REMOTE = ("gs://", "hf://", "s3://", "http://", "https://")
READ_CHUNK = 4096


# --- tf.train.Example without TensorFlow --------------------------------------------------

@functools.lru_cache(maxsize=1)
def example_class():
    """A message class with the wire layout of ``tf.train.Example`` (in a private pool)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    proto = descriptor_pb2.FileDescriptorProto(name="jaxtrain_example.proto",
                                               package="jaxtrain.example", syntax="proto3")

    def message(name, *fields):
        m = proto.message_type.add(name=name)
        for fname, number, ftype, label, type_name, oneof in fields:
            f = m.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                f.type_name = type_name
            if oneof is not None:
                f.oneof_index = oneof
        return m

    rep, opt = F.LABEL_REPEATED, F.LABEL_OPTIONAL
    message("BytesList", ("value", 1, F.TYPE_BYTES, rep, None, None))
    message("FloatList", ("value", 1, F.TYPE_FLOAT, rep, None, None))
    message("Int64List", ("value", 1, F.TYPE_INT64, rep, None, None))
    feature = message("Feature",
                      ("bytes_list", 1, F.TYPE_MESSAGE, opt, ".jaxtrain.example.BytesList", 0),
                      ("float_list", 2, F.TYPE_MESSAGE, opt, ".jaxtrain.example.FloatList", 0),
                      ("int64_list", 3, F.TYPE_MESSAGE, opt, ".jaxtrain.example.Int64List", 0))
    feature.oneof_decl.add(name="kind")
    features = message("Features", ("feature", 1, F.TYPE_MESSAGE, rep,
                                     ".jaxtrain.example.Features.FeatureEntry", None))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=F.TYPE_MESSAGE, label=opt,
                    type_name=".jaxtrain.example.Feature")
    entry.options.map_entry = True
    message("Example", ("features", 1, F.TYPE_MESSAGE, opt, ".jaxtrain.example.Features", None))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("jaxtrain.example.Example"))


def make_example(features: dict) -> bytes:
    """A serialised Example of ``{name: str | bytes | list[int] | list[float]}`` (for tests and
    for exporting data)."""
    ex = example_class()()
    for name, value in features.items():
        feat = ex.features.feature[name]
        if isinstance(value, (str, bytes)):
            feat.bytes_list.value.append(value.encode() if isinstance(value, str) else value)
        elif all(isinstance(v, (int, np.integer)) for v in value):
            feat.int64_list.value.extend(int(v) for v in value)
        else:
            feat.float_list.value.extend(float(v) for v in value)
    return ex.SerializeToString()


def _example_features(record: bytes):
    """The feature map of ``record`` when it is an Example with features, else None."""
    ex = example_class()()
    try:
        ex.ParseFromString(record)
    except Exception:  # noqa: BLE001 - protobuf's DecodeError, or a C-level error
        return None
    return ex.features.feature if len(ex.features.feature) else None


def _json_object(record: bytes) -> dict | None:
    """The record as a JSON object, or None when it is not one."""
    if record[:1] != b"{":
        return None
    try:
        row = json.loads(record)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return row if isinstance(row, dict) else None


def _ids_hint(key: str) -> str:
    return f"{key} is false (token ids expected); set it to true"


def record_ids(record: bytes, field: str, where: str, key: str = "tokenize_train_data"):
    """The token ids of one record: an Example's int64_list feature or a JSON list field."""
    row = _json_object(record)
    if row is not None:
        value = row.get(field)
        if not isinstance(value, list) or not all(
                isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{where}: JSON field {field!r} is not a list of token ids "
                              f"({_ids_hint(key)} if it holds text)")
        return value
    features = _example_features(record)
    if features is None:
        raise ConfigError(f"{where}: not a tf.train.Example or JSON record, so it holds no "
                          f"token ids ({_ids_hint(key)} for text records)")
    if field not in features:
        raise ConfigError(f"{where}: the tf.train.Example has no {field!r} feature (it has "
                          f"{sorted(features)}); train_data_columns names the feature to read")
    feat = features[field]
    kind = feat.WhichOneof("kind")
    if kind == "bytes_list":
        raise ConfigError(f"{where}: feature {field!r} holds text, and {_ids_hint(key)}")
    if kind != "int64_list":
        raise ConfigError(f"{where}: feature {field!r} is not token ids (an int64_list; it is "
                          f"{kind or 'empty'})")
    return list(feat.int64_list.value)


def record_text(record: bytes, field: str, where: str,
                key: str = "tokenize_train_data") -> str:
    """The document text of one record (an Example, a JSON object or UTF-8 text)."""
    row = _json_object(record)
    if row is not None:
        if field not in row:
            raise ConfigError(f"{where}: the JSON record has no {field!r} field (it has "
                              f"{sorted(row)}); train_data_columns names the field to read")
        if not isinstance(row[field], str):
            raise ConfigError(f"{where}: field {field!r} is not a string")
        return row[field]
    features = _example_features(record)
    if features is not None:
        if field not in features:
            raise ConfigError(f"{where}: the tf.train.Example has no {field!r} feature (it has "
                              f"{sorted(features)}); train_data_columns names the feature to "
                              "read")
        feat = features[field]
        kind = feat.WhichOneof("kind")
        if kind == "int64_list":
            raise ConfigError(f"{where}: feature {field!r} holds token ids (int64_list); "
                              f"set {key}: false to read them as they are")
        if kind != "bytes_list" or not feat.bytes_list.value:
            raise ConfigError(f"{where}: feature {field!r} is not text (a non-empty "
                              f"bytes_list; it is {kind or 'empty'})")
        try:
            return feat.bytes_list.value[0].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: feature {field!r} is not UTF-8 text: {e}") from e
    try:
        return record.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: a corrupt or unknown record: neither a tf.train.Example, "
                          "a JSON object nor UTF-8 text") from None


# --- record files ------------------------------------------------------------------------

def _arrayrecord(path: str):
    from array_record.python.array_record_module import ArrayRecordReader

    try:
        reader = ArrayRecordReader(path)
    except Exception as e:  # noqa: BLE001 - the C++ reader raises RuntimeError
        raise ConfigError(f"{path}: not a readable ArrayRecord file: {e}") from e
    try:
        if not reader.ok():
            raise ConfigError(f"{path}: not a readable ArrayRecord file")
        n = reader.num_records()
        for start in range(0, n, READ_CHUNK):
            try:
                chunk = reader.read(start, min(n, start + READ_CHUNK))
            except Exception as e:  # noqa: BLE001
                raise ConfigError(f"{path}: records {start}..: cannot read them: {e}") from e
            yield from chunk
    finally:
        try:
            reader.close()
        except Exception:  # noqa: BLE001 - closing a reader that failed to open raises
            pass


def _crc32c_table():
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC-32C."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord_bytes(records) -> bytes:
    """A TFRecord file holding ``records`` (for tests and for exporting data)."""
    out = bytearray()
    for r in records:
        head = struct.pack("<Q", len(r))
        out += head + struct.pack("<I", masked_crc(head)) + r + struct.pack("<I", masked_crc(r))
    return bytes(out)


def _tfrecord(path: str):
    """The records of a TFRecord file; each length's checksum is checked (the records' own
    checksums are not: computing them in Python would be slow)."""
    with open(path, "rb") as f:
        data = f.read()
    pos, i = 0, 0
    while pos < len(data):
        if pos + 12 > len(data):
            raise ConfigError(f"{path}: record {i}: truncated TFRecord file")
        head = data[pos:pos + 8]
        (length,) = struct.unpack("<Q", head)
        if struct.unpack("<I", data[pos + 8:pos + 12])[0] != masked_crc(head):
            raise ConfigError(f"{path}: record {i}: bad length checksum: not a TFRecord file, "
                              "or a corrupt one")
        start = pos + 12
        if start + length + 4 > len(data):
            raise ConfigError(f"{path}: record {i}: truncated TFRecord file")
        yield data[start:start + length]
        pos, i = start + length + 4, i + 1


def _parquet_column(path: str, field: str):
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
        if field not in names:
            raise ConfigError(f"{path}: the parquet file has no {field!r} column (it has "
                              f"{names}); train_data_columns names the column to read")
        return pf.read(columns=[field]).column(field)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001
        raise ConfigError(f"{path}: not a readable parquet file: {e}") from e


def _is_text(type_) -> bool:
    import pyarrow as pa

    return (pa.types.is_string(type_) or pa.types.is_large_string(type_)
            or pa.types.is_binary(type_) or pa.types.is_large_binary(type_))


def _is_ids(type_) -> bool:
    import pyarrow as pa

    return ((pa.types.is_list(type_) or pa.types.is_large_list(type_))
            and pa.types.is_integer(type_.value_type))


def _parquet_texts(path: str, field: str, key: str = "tokenize_train_data"):
    column = _parquet_column(path, field)
    if not _is_text(column.type):
        raise ConfigError(f"{path}: column {field!r} is {column.type}, not text" + (
            f" (it holds token ids: set {key}: false)" if _is_ids(column.type) else ""))
    for i, value in enumerate(column.to_pylist()):
        if value is None:
            raise ConfigError(f"{path}: row {i + 1}: column {field!r} is null")
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}: row {i + 1}: column {field!r} is not UTF-8: "
                                  f"{e}") from e
        yield value


def _parquet_ids(path: str, field: str, key: str):
    column = _parquet_column(path, field)
    if not _is_ids(column.type):
        raise ConfigError(f"{path}: column {field!r} is {column.type}, not token ids (a list "
                          "of integers)" + (f"; {_ids_hint(key)}" if _is_text(column.type)
                                            else ""))
    for i, value in enumerate(column.to_pylist()):
        if value is None:
            raise ConfigError(f"{path}: row {i + 1}: column {field!r} is null")
        yield value


def read_texts(files: list[str], file_type: str, field: str, token_ids: bool = False,
               tokenize_key: str = "tokenize_train_data"):
    """Every document of ``files``, in order: its text, or with ``token_ids`` its list of
    token ids; a ConfigError names a bad file or record (and ``tokenize_key`` when the field
    holds the other kind)."""
    if file_type not in FILE_TYPES:
        raise ConfigError(f"grain_file_type {file_type!r}: expected one of {FILE_TYPES}")
    for path in files:
        n = 0
        if file_type == "parquet":
            docs = (_parquet_ids if token_ids else _parquet_texts)(path, field, tokenize_key)
        else:
            records = _arrayrecord(path) if file_type == "arrayrecord" else _tfrecord(path)
            read = record_ids if token_ids else record_text
            docs = (read(r, field, f"{path}: record {i}", tokenize_key)
                    for i, r in enumerate(records))
        for doc in docs:
            n += 1
            yield doc
        if n == 0:
            raise ConfigError(f"{path}: the file holds no records")


# --- which files, and mixtures -----------------------------------------------------------

def find_files(pattern: str, what: str) -> list[str]:
    """The local files a glob matches, sorted; a ConfigError when none does."""
    pattern = pattern.strip()
    if pattern.startswith(REMOTE):
        raise ConfigError(f"{what} {pattern!r}: jaxtrain reads local files only (nothing is "
                          "downloaded): mount the bucket (e.g. with gcsfuse) and give the "
                          "mounted path")
    found = sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True)
                   if os.path.isfile(f))
    if not found:
        raise ConfigError(f"{what} {pattern!r}: no file matches")
    return found


def parse_sources(spec: str, what: str) -> list[tuple[str, float | None]]:
    """``"glob"`` -> [(glob, None)]; ``"g1,w1;g2,w2"`` -> [(g1, w1), (g2, w2)]."""
    spec = str(spec).strip()
    if ";" not in spec:
        return [(spec, None)]
    out = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        pattern, _, weight = part.rpartition(",")
        try:
            out.append((pattern.strip(), float(weight)))
        except ValueError:
            pattern = ""
        if not pattern:
            raise ConfigError(f"{what}: {part!r} is not 'glob,weight' (a mixture is "
                              "'glob,weight;glob,weight')")
    return out


def mixture_file(path: str) -> list[tuple[str, float]]:
    """The sources of a grain_train_mixture_config_path JSON file: [(glob, weight)]."""
    what = "grain_train_mixture_config_path"
    if not os.path.isfile(path):
        raise ConfigError(f"{what} {path!r}: no such file")
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} {path}: not valid JSON: {e}") from e
    if not isinstance(spec, dict) or not spec:
        raise ConfigError(f"{what} {path}: expected a JSON object of "
                          "{name: {path, weight}} sources")
    out = []
    for name, entry in spec.items():
        if not isinstance(entry, dict) or "path" not in entry or "weight" not in entry:
            raise ConfigError(f"{what} {path}: source {name!r} needs a path and a weight")
        try:
            out.append((str(entry["path"]), float(entry["weight"])))
        except (TypeError, ValueError):
            raise ConfigError(f"{what} {path}: source {name!r}: weight "
                              f"{entry['weight']!r} is not a number") from None
    return out


def mix(sources: list[list], weights: list[float], seed: int) -> list:
    """Documents drawn from ``sources`` by weight: as many as they hold together."""
    weights = normalize(weights)
    for docs, w in zip(sources, weights):
        if w > 0 and not docs:
            raise ConfigError("grain mixture: a source with a positive weight holds no "
                              "documents")
    which, nth = blending_indices(weights, sum(len(d) for d in sources))
    orders: dict[tuple[int, int], np.ndarray] = {}
    out = []
    for s, k in zip(which.tolist(), nth.tolist()):
        docs = sources[s]
        epoch, j = divmod(k, len(docs))
        order = orders.get((s, epoch))
        if order is None:
            order = orders[(s, epoch)] = np.random.default_rng([seed, s, epoch]).permutation(
                len(docs))
        out.append(docs[int(order[j])])
    return out
