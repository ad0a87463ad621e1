#!/usr/bin/env python3
"""A grpcio client of `checkout.Checkout/Pay`, without generated stubs: the request is encoded and
the reply decoded by hand, and the call sends and receives raw bytes.

    client.py HOST:PORT IDEMPOTENCY_KEY ORDER AMOUNT_CENTS

It retries the call with the same key while it fails `UNAVAILABLE` (as a lost connection does),
then prints one JSON line: the attempts made, the final code, and, on success, whether the answer
was a replay (`idempotent-replayed: true`) and the reply's fields.
"""

import json
import sys
import time

import grpc

PAY = "/checkout.Checkout/Pay"


def varint(value):
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_request(order, amount_cents):
    """`PayRequest { string order = 1; uint64 amount_cents = 2; }`."""
    order = order.encode()
    return b"\x0a" + varint(len(order)) + order + b"\x10" + varint(amount_cents)


def decode_reply(data):
    """`PayReply { string payment_id = 1; uint32 run = 2; }`."""
    fields = {}
    at = 0

    def read_varint():
        nonlocal at
        value, shift = 0, 0
        while True:
            byte = data[at]
            at += 1
            value |= (byte & 0x7F) << shift
            shift += 7
            if byte < 0x80:
                return value

    while at < len(data):
        tag = read_varint()
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            fields[number] = read_varint()
        elif wire == 2:
            length = read_varint()
            fields[number] = data[at : at + length]
            at += length
        else:
            raise ValueError("unexpected wire type %d" % wire)
    return {
        "payment_id": fields.get(1, b"").decode(),
        "run": fields.get(2, 0),
    }


def main():
    target, key, order, amount = sys.argv[1:5]
    channel = grpc.insecure_channel(
        target,
        options=[
            # The retries are this client's own, with the same key: none by the library.
            ("grpc.enable_retries", 0),
            # Straight to the test's proxy, whatever proxy the environment names.
            ("grpc.enable_http_proxy", 0),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ],
    )
    pay = channel.unary_unary(PAY, request_serializer=None, response_deserializer=None)
    request = encode_request(order, int(amount))
    attempts = 0
    while True:
        attempts += 1
        try:
            reply, call = pay.with_call(
                request,
                metadata=[("idempotency-key", key)],
                timeout=10,
                wait_for_ready=attempts > 1,
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNAVAILABLE and attempts < 5:
                time.sleep(0.1)
                continue
            print(json.dumps({
                "attempts": attempts,
                "code": error.code().name,
                "details": error.details(),
            }))
            return
        headers = dict(call.initial_metadata())
        result = {
            "attempts": attempts,
            "code": "OK",
            "replayed": headers.get("idempotent-replayed") == "true",
        }
        result.update(decode_reply(reply))
        print(json.dumps(result))
        return


if __name__ == "__main__":
    main()
