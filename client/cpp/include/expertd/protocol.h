// expertd's wire contract in C++, without torch. PROTOCOL.md (repository root) is the contract;
// expertd/protocol.py is its Python side; tests/golden/protocol holds the vectors both sides check.
#pragma once

#include "expertd/connection.h"  // envelopes, credentials, the REQ connection
#include "expertd/errors.h"      // the typed errors
#include "expertd/index.h"       // index segment, tensor index, checksums, dtypes, mappings
#include "expertd/value.h"       // msgpack values
#include "expertd/wire.h"        // version, endpoint, caps
