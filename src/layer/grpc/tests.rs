use super::*;
use http_body_util::BodyExt;

/// A protobuf message read back: its fields by number, each value as varint or bytes, in order.
fn fields(mut bytes: &[u8]) -> Vec<(u32, Field)> {
    fn varint(bytes: &mut &[u8]) -> u64 {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = bytes.split_first().expect("a varint");
            *bytes = rest;
            value |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                break;
            }
        }
        value
    }
    let mut out = Vec::new();
    while !bytes.is_empty() {
        let tag = varint(&mut bytes);
        let field = (tag >> 3) as u32;
        match tag & 7 {
            0 => out.push((field, Field::Int(varint(&mut bytes)))),
            2 => {
                let len = varint(&mut bytes) as usize;
                out.push((field, Field::Bytes(bytes[..len].to_vec())));
                bytes = &bytes[len..];
            }
            wire => panic!("wire type {wire}"),
        }
    }
    out
}

#[derive(Debug, PartialEq)]
enum Field {
    Int(u64),
    Bytes(Vec<u8>),
}

fn bytes_of(fields: &[(u32, Field)], number: u32) -> Vec<Vec<u8>> {
    fields
        .iter()
        .filter(|(n, _)| *n == number)
        .map(|(_, f)| match f {
            Field::Bytes(b) => b.clone(),
            Field::Int(_) => panic!("field {number} is a varint"),
        })
        .collect()
}

fn unbase64(text: &str) -> Vec<u8> {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut bits = 0u32;
    let mut count = 0;
    let mut out = Vec::new();
    for c in text.bytes() {
        let v = ALPHABET.iter().position(|&a| a == c).expect("base64") as u32;
        bits = bits << 6 | v;
        count += 6;
        if count >= 8 {
            count -= 8;
            out.push((bits >> count) as u8);
        }
    }
    out
}

#[test]
fn every_error_has_the_grpc_status_the_contract_names() {
    assert_eq!(code_of(ErrorKind::InProgress), code::ABORTED);
    assert_eq!(code_of(ErrorKind::KeyReuse), code::FAILED_PRECONDITION);
    assert_eq!(
        code_of(ErrorKind::MissingIdempotencyKey),
        code::INVALID_ARGUMENT
    );
    assert_eq!(
        code_of(ErrorKind::InvalidIdempotencyKey),
        code::INVALID_ARGUMENT
    );
    assert_eq!(code_of(ErrorKind::StoreUnavailable), code::UNAVAILABLE);
    assert_eq!(
        code_of(ErrorKind::RequestTooLarge),
        code::RESOURCE_EXHAUSTED
    );
    assert_eq!(code_of(ErrorKind::HandlerTimeout), code::DEADLINE_EXCEEDED);
    assert_eq!(code_of(ErrorKind::InternalError), code::INTERNAL);
    for kind in ErrorKind::ALL {
        let status = code_of(kind);
        assert!((1..=16).contains(&status), "{kind:?}: an error, never OK");
        // A retryable HTTP answer stays retryable as a gRPC one, and the reverse.
        let retryable_http = matches!(kind.status().as_u16(), 409 | 429 | 503 | 408);
        let retryable_grpc = matches!(
            status,
            code::ABORTED | code::UNAVAILABLE | code::RESOURCE_EXHAUSTED | code::DEADLINE_EXCEEDED
        );
        if retryable_http {
            assert!(retryable_grpc, "{kind:?}");
        }
    }
}

#[test]
fn the_default_policy_follows_the_http_one_through_the_grpc_mapping() {
    // The HTTP status gRPC's own mapping gives each code.
    let http_of = |c: u32| match c {
        code::OK => 200,
        code::CANCELLED => 499,
        code::INVALID_ARGUMENT | code::OUT_OF_RANGE | code::FAILED_PRECONDITION => 400,
        code::DEADLINE_EXCEEDED => 504,
        code::NOT_FOUND => 404,
        code::ALREADY_EXISTS | code::ABORTED => 409,
        code::PERMISSION_DENIED => 403,
        code::RESOURCE_EXHAUSTED => 429,
        code::UNIMPLEMENTED => 501,
        code::UNAVAILABLE => 503,
        code::UNAUTHENTICATED => 401,
        _ => 500,
    };
    for status in 0..=20 {
        let http = StatusCode::from_u16(http_of(status)).expect("status");
        let expected = match (status, crate::layer::default_policy(http)) {
            // ALREADY_EXISTS is definitive, though gRPC maps it to 409 as it does ABORTED.
            (code::ALREADY_EXISTS, _) => Disposition::Fail,
            // FAILED_PRECONDITION and OUT_OF_RANGE map to 400: definitive, as it is.
            (_, d) => d,
        };
        assert_eq!(default_grpc_policy(status), expected, "code {status}");
    }
    assert_eq!(default_grpc_policy(code::OK), Disposition::Complete);
    assert_eq!(default_grpc_policy(code::UNAVAILABLE), Disposition::Release);
    assert_eq!(
        default_grpc_policy(code::DEADLINE_EXCEEDED),
        Disposition::Release
    );
    assert_eq!(default_grpc_policy(code::INTERNAL), Disposition::Release);
    assert_eq!(
        default_grpc_policy(code::INVALID_ARGUMENT),
        Disposition::Fail
    );
    assert_eq!(default_grpc_policy(code::NOT_FOUND), Disposition::Fail);
}

#[test]
fn a_policy_that_panics_records_rather_than_releases() {
    let settings = GrpcSettings::new().status_policy(|_| panic!("policy"));
    assert_eq!(settings.disposition(code::OK), Disposition::Complete);
    assert_eq!(settings.disposition(code::UNAVAILABLE), Disposition::Fail);
}

#[test]
fn the_layers_answers_are_trailers_only_statuses_with_their_details() {
    let instance = "urn:uuid:00000000-0000-4000-8000-000000000000";
    let response = status_answer(
        ErrorKind::InProgress,
        "still running: 100% sure",
        Some(2),
        instance,
    );
    assert_eq!(response.status(), StatusCode::OK);
    let headers = response.headers();
    assert_eq!(headers[http::header::CONTENT_TYPE], "application/grpc");
    assert_eq!(headers["grpc-status"], "10");
    assert_eq!(headers["grpc-message"], "still running: 100%25 sure");
    assert_eq!(headers["grpc-retry-pushback-ms"], "2000");
    assert!(http_body::Body::is_end_stream(response.body()));

    let details = unbase64(headers["grpc-status-details-bin"].to_str().expect("ascii"));
    let status = fields(&details);
    assert_eq!(status[0], (1, Field::Int(10)));
    assert_eq!(bytes_of(&status, 2), [b"still running: 100% sure".to_vec()]);
    let anys = bytes_of(&status, 3);
    assert_eq!(anys.len(), 2, "ErrorInfo and RetryInfo");
    let info = fields(&anys[0]);
    assert_eq!(
        bytes_of(&info, 1),
        [b"type.googleapis.com/google.rpc.ErrorInfo".to_vec()]
    );
    let error_info = fields(&bytes_of(&info, 2)[0]);
    assert_eq!(bytes_of(&error_info, 1), [b"in_progress".to_vec()]);
    assert_eq!(bytes_of(&error_info, 2), [b"axum-idempotency".to_vec()]);
    let entry = fields(&bytes_of(&error_info, 3)[0]);
    assert_eq!(bytes_of(&entry, 1), [b"instance".to_vec()]);
    assert_eq!(bytes_of(&entry, 2), [instance.as_bytes().to_vec()]);
    let retry = fields(&anys[1]);
    assert_eq!(
        bytes_of(&retry, 1),
        [b"type.googleapis.com/google.rpc.RetryInfo".to_vec()]
    );
    let delay = fields(&bytes_of(&fields(&bytes_of(&retry, 2)[0]), 1)[0]);
    assert_eq!(delay, [(1, Field::Int(2))]);

    // Not retryable: no pushback, no RetryInfo.
    let response = status_answer(ErrorKind::KeyReuse, "reused", None, instance);
    assert_eq!(response.headers()["grpc-status"], "9");
    assert!(response.headers().get("grpc-retry-pushback-ms").is_none());
    let details = unbase64(
        response.headers()["grpc-status-details-bin"]
            .to_str()
            .expect("ascii"),
    );
    let anys = bytes_of(&fields(&details), 3);
    assert_eq!(anys.len(), 1);
    let error_info = fields(&bytes_of(&fields(&anys[0]), 2)[0]);
    assert_eq!(
        bytes_of(&error_info, 1),
        [b"idempotency_key_reuse".to_vec()]
    );
}

#[test]
fn base64_is_unpadded_and_exact() {
    for (plain, encoded) in [
        ("", ""),
        ("f", "Zg"),
        ("fo", "Zm8"),
        ("foo", "Zm9v"),
        ("foob", "Zm9vYg"),
        ("fooba", "Zm9vYmE"),
        ("foobar", "Zm9vYmFy"),
    ] {
        assert_eq!(base64(plain.as_bytes()), encoded);
        assert_eq!(unbase64(encoded), plain.as_bytes());
    }
    let all: Vec<u8> = (0..=255).collect();
    assert_eq!(unbase64(&base64(&all)), all);
}

#[test]
fn grpc_message_is_percent_encoded() {
    assert_eq!(percent_encode("plain text"), "plain text");
    assert_eq!(percent_encode("50%"), "50%25");
    assert_eq!(percent_encode("caf\u{e9}\n"), "caf%C3%A9%0A");
}

#[test]
fn only_grpc_content_types_are_grpc() {
    let with = |value: &'static str| {
        let mut headers = HeaderMap::new();
        headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(value));
        is_grpc(&headers)
    };
    assert!(with("application/grpc"));
    assert!(with("application/grpc+proto"));
    assert!(with("application/grpc;charset=utf-8"));
    assert!(!with("application/grpc-web"));
    assert!(!with("application/json"));
    assert!(!is_grpc(&HeaderMap::new()));
}

#[test]
fn settings_name_well_formed_unary_methods() {
    assert!(GrpcSettings::new().check().is_err(), "none named");
    assert!(GrpcSettings::new().unary(["/a.B/C"]).check().is_ok());
    for bad in ["a.B/C", "/a.B", "/a.B/", "//C", "/a/B/C"] {
        assert!(GrpcSettings::new().unary([bad]).check().is_err(), "{bad}");
    }
    let settings = GrpcSettings::new().unary(["/a.B/C"]);
    let request = |path: &str, content_type: &'static str| {
        http::Request::post(path)
            .header(http::header::CONTENT_TYPE, content_type)
            .body(())
            .expect("request")
    };
    assert!(settings.guards(&request("/a.B/C", "application/grpc")));
    assert!(!settings.guards(&request("/a.B/D", "application/grpc")));
    assert!(!settings.guards(&request("/a.B/C", "application/grpc-web")));
}

#[test]
fn the_fingerprint_covers_the_method_and_the_frames() {
    let parts = |path: &str| {
        http::Request::post(path)
            .body(())
            .expect("request")
            .into_parts()
            .0
    };
    let a = fingerprint(&parts("/a.B/C"), b"\0\0\0\0\x02\x08\x01");
    assert_eq!(a, fingerprint(&parts("/a.B/C"), b"\0\0\0\0\x02\x08\x01"));
    assert_ne!(a, fingerprint(&parts("/a.B/D"), b"\0\0\0\0\x02\x08\x01"));
    assert_ne!(a, fingerprint(&parts("/a.B/C"), b"\0\0\0\0\x02\x08\x02"));
}

/// The frames of `body`: its data, then its trailers.
async fn frames_of(body: Body) -> (Bytes, Option<HeaderMap>) {
    let collected = body.collect().await.expect("body");
    let trailers = collected.trailers().cloned();
    (collected.to_bytes(), trailers)
}

#[tokio::test]
async fn trailers_are_kept_in_the_record_and_replayed_as_trailers() {
    let allowed: Vec<HeaderName> = crate::layer::settings::DEFAULT_STORED_HEADERS
        .into_iter()
        .chain(GRPC_HEADERS)
        .collect();
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    let message = Bytes::from_static(b"\0\0\0\0\x03\x0a\x01x");
    let mut stored = replay::capture(
        Finished::Failed,
        StatusCode::OK,
        &headers,
        &allowed,
        Some(message.clone()),
    );
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", HeaderValue::from_static("5"));
    trailers.insert("grpc-message", HeaderValue::from_static("no%20such"));
    trailers.insert("grpc-status-details-bin", HeaderValue::from_static("CAU"));
    // Not on the allow-list: not kept.
    trailers.insert("x-debug", HeaderValue::from_static("1"));
    keep_trailers(&mut stored, &trailers, &allowed);
    let names: Vec<&str> = stored.headers.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "content-type",
            "idempotency-trailer-grpc-status",
            "idempotency-trailer-grpc-message",
            "idempotency-trailer-grpc-status-details-bin",
        ]
    );

    let marker = crate::header::IDEMPOTENT_REPLAYED;
    let response = with_trailers(
        &allowed,
        &stored,
        replay::replay(&stored, &marker, &allowed),
    );
    let headers = response.headers().clone();
    assert_eq!(headers[http::header::CONTENT_TYPE], "application/grpc");
    assert_eq!(headers[&marker], "true");
    assert!(
        headers.get("grpc-status").is_none(),
        "a trailer, not a header"
    );
    assert!(
        headers
            .keys()
            .all(|n| !n.as_str().starts_with(TRAILER_PREFIX)),
        "{headers:?}"
    );
    let (data, replayed) = frames_of(response.into_body()).await;
    assert_eq!(data, message);
    let replayed = replayed.expect("trailers");
    assert_eq!(replayed["grpc-status"], "5");
    assert_eq!(replayed["grpc-message"], "no%20such");
    assert_eq!(replayed["grpc-status-details-bin"], "CAU");
    assert!(replayed.get("x-debug").is_none());
}

#[tokio::test]
async fn a_trailers_only_record_replays_trailers_only() {
    let allowed: Vec<HeaderName> = crate::layer::settings::DEFAULT_STORED_HEADERS
        .into_iter()
        .chain(GRPC_HEADERS)
        .collect();
    let stored = handler_timeout();
    let marker = crate::header::IDEMPOTENT_REPLAYED;
    let response = with_trailers(
        &allowed,
        &stored,
        replay::replay(&stored, &marker, &allowed),
    );
    assert_eq!(response.headers()["grpc-status"], "4");
    assert!(response.headers().get("grpc-status-details-bin").is_some());
    assert!(http_body::Body::is_end_stream(response.body()));
}

#[test]
fn an_http_answer_cannot_forge_a_recorded_trailer() {
    let mut headers = HeaderMap::new();
    headers.insert(
        "idempotency-trailer-grpc-status",
        HeaderValue::from_static("0"),
    );
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain"),
    );
    // Even named on the allow-list, it is not recorded.
    let allowed = [
        http::header::CONTENT_TYPE,
        HeaderName::from_static("idempotency-trailer-grpc-status"),
    ];
    let stored = replay::capture(
        Finished::Completed,
        StatusCode::OK,
        &headers,
        &allowed,
        Some(Bytes::new()),
    );
    assert_eq!(stored.headers.len(), 1);
    assert_eq!(stored.headers[0].0, http::header::CONTENT_TYPE);
}

#[test]
fn a_grpc_layer_refuses_the_settings_that_make_no_sense_for_it() {
    use crate::{IdempotencyLayer, MemoryStore};
    let setting = |b: crate::IdempotencyLayerBuilder<MemoryStore>| match b.build() {
        Ok(_) => panic!("configuration accepted"),
        Err(e) => e.setting().to_owned(),
    };
    let builder = || IdempotencyLayer::builder(MemoryStore::new());
    let unary = || GrpcSettings::new().unary(["/a.B/C"]);
    assert_eq!(setting(builder().grpc(GrpcSettings::new())), "grpc");
    assert_eq!(
        setting(builder().grpc(unary()).fingerprint_ignore(["/ts"])),
        "fingerprint_ignore"
    );
    assert_eq!(
        setting(builder().grpc(unary()).key_from_body("/request_id")),
        "key_from_body"
    );
    assert_eq!(
        setting(builder().grpc(unary()).methods([http::Method::PATCH])),
        "grpc"
    );
    let layer = builder().grpc(unary()).build().expect("valid");
    // The status, message, details and encoding are recorded; the fingerprint is gRPC's.
    for name in GRPC_HEADERS {
        assert!(layer.http.stored_headers.contains(&name), "{name}");
    }
    let parts = http::Request::post("/a.B/C")
        .body(())
        .expect("request")
        .into_parts()
        .0;
    assert_eq!(
        layer.http.fingerprint.of(&parts, b"frames"),
        fingerprint(&parts, b"frames")
    );
}

/// The recorder of the gRPC mode, over the memory store, under a paused clock.
mod recorder {
    use super::*;
    use crate::engine::tests::{claimed, engine};
    use crate::store::{ClaimOutcome, ClaimRequest, LeaseToken};

    fn grpc_http() -> LayerSettings {
        let grpc = Arc::new(GrpcSettings::new().unary(["/a.B/C"]));
        let mut http = LayerSettings {
            grpc: Some(grpc.clone()),
            ..LayerSettings::default()
        };
        http.grpc_mode(grpc).expect("gRPC mode");
        http
    }

    /// A gRPC answer whose body is `frames`.
    fn answer(frames: Vec<Result<Frame<Bytes>, std::io::Error>>, pending: bool) -> Response<Body> {
        use futures_util::StreamExt as _;
        let rest = if pending {
            futures_util::stream::pending().boxed()
        } else {
            futures_util::stream::empty().boxed()
        };
        let body = futures_util::stream::iter(frames).chain(rest);
        Response::builder()
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .body(Body::new(http_body_util::StreamBody::new(body)))
            .expect("response")
    }

    fn status_trailers(status: &'static str) -> Frame<Bytes> {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static(status));
        Frame::trailers(trailers)
    }

    /// What a retry of `claim` finds: the record, or `None` when the key is free again.
    async fn record_of<St: IdempotencyStore>(
        store: &St,
        claim: &ClaimRequest,
    ) -> Option<StoredResponse> {
        let again = ClaimRequest {
            lease: LeaseToken::generate(),
            ..claim.clone()
        };
        match store.claim(&again).await.expect("claim") {
            ClaimOutcome::Finished(stored) => Some(StoredResponse::clone(&stored)),
            ClaimOutcome::Claimed { .. } => None,
            other => panic!("expected a record or a free key, got {other:?}"),
        }
    }

    fn status_of(stored: &StoredResponse) -> Option<&str> {
        stored
            .headers
            .iter()
            .find(|(n, _)| n == "grpc-status" || n == "idempotency-trailer-grpc-status")
            .and_then(|(_, v)| v.to_str().ok())
    }

    #[tokio::test(start_paused = true)]
    async fn the_status_in_the_trailers_decides_and_is_kept() {
        let http = grpc_http();
        let grpc = http.grpc.clone().expect("grpc");
        let (engine, store) = engine();
        let (claim, lease) = claimed(&engine, "ok").await;
        let frames = vec![
            Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\x01\x08"))),
            Ok(status_trailers("0")),
        ];
        let sent = record(&http, &grpc, lease, answer(frames, false)).await;
        let stored = record_of(&store, &claim).await.expect("recorded");
        assert_eq!(stored.outcome, Finished::Completed);
        assert_eq!(&stored.body[..], b"\0\0\0\0\x01\x08");
        assert_eq!(status_of(&stored), Some("0"));
        let (data, trailers) = frames_of(sent.into_body()).await;
        assert_eq!(&data[..], b"\0\0\0\0\x01\x08");
        assert_eq!(trailers.expect("trailers")["grpc-status"], "0");

        // UNAVAILABLE: released; the client gets the answer as it was.
        let (claim, lease) = claimed(&engine, "unavailable").await;
        let sent = record(
            &http,
            &grpc,
            lease,
            answer(vec![Ok(status_trailers("14"))], false),
        )
        .await;
        assert!(record_of(&store, &claim).await.is_none(), "released");
        let (_, trailers) = frames_of(sent.into_body()).await;
        assert_eq!(trailers.expect("trailers")["grpc-status"], "14");
    }

    #[tokio::test(start_paused = true)]
    async fn the_handlers_disposition_decides_over_the_status_policy() {
        let http = grpc_http();
        let grpc = http.grpc.clone().expect("grpc");
        let (engine, store) = engine();
        let (claim, lease) = claimed(&engine, "said").await;
        let mut response = answer(vec![Ok(status_trailers("14"))], false);
        response.extensions_mut().insert(Disposition::Fail);
        record(&http, &grpc, lease, response).await;
        let stored = record_of(&store, &claim)
            .await
            .expect("recorded, not released");
        assert_eq!(stored.outcome, Finished::Failed);
        assert_eq!(status_of(&stored), Some("14"));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_without_a_status_is_recorded_as_failed() {
        let http = grpc_http();
        let grpc = http.grpc.clone().expect("grpc");
        let (engine, store) = engine();
        let (claim, lease) = claimed(&engine, "no-status").await;
        let frames = vec![Ok(Frame::data(Bytes::from_static(b"\0\0\0\0\0")))];
        record(&http, &grpc, lease, answer(frames, false)).await;
        let stored = record_of(&store, &claim).await.expect("recorded");
        assert_eq!(stored.outcome, Finished::Failed);
        assert_eq!(status_of(&stored), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_fails_is_recorded_and_answered_as_lost() {
        let http = grpc_http();
        let grpc = http.grpc.clone().expect("grpc");
        let (engine, store) = engine();
        let (claim, lease) = claimed(&engine, "fails").await;
        let frames = vec![
            Ok(Frame::data(Bytes::from_static(b"\0\0\0"))),
            Err(std::io::Error::other("reset")),
        ];
        let sent = record(&http, &grpc, lease, answer(frames, false)).await;
        assert_eq!(sent.headers()["grpc-status"], "15");
        let stored = record_of(&store, &claim)
            .await
            .expect("recorded, never released");
        assert_eq!(stored.outcome, Finished::Failed);
        assert!(stored.body_omitted);
        assert_eq!(status_of(&stored), Some("15"));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_still_streaming_at_the_maximum_hold_is_recorded_as_a_timeout() {
        let http = grpc_http();
        let grpc = http.grpc.clone().expect("grpc");
        let (engine, store) = engine();
        let (claim, lease) = claimed(&engine, "endless").await;
        let frames = vec![Ok(Frame::data(Bytes::from_static(b"\0\0\0")))];
        let sent = record(&http, &grpc, lease, answer(frames, true)).await;
        assert_eq!(sent.headers()["grpc-status"], "4");
        let stored = record_of(&store, &claim).await.expect("recorded");
        assert_eq!(status_of(&stored), Some("4"));
    }

    #[tokio::test(start_paused = true)]
    async fn an_answer_that_is_not_grpc_is_recorded_as_http() {
        let http = grpc_http();
        let grpc = http.grpc.clone().expect("grpc");
        let (engine, store) = engine();
        let (claim, lease) = claimed(&engine, "http").await;
        let response = Response::builder()
            .status(404)
            .header(http::header::CONTENT_TYPE, "text/html")
            .body(Body::from("not here"))
            .expect("response");
        record(&http, &grpc, lease, response).await;
        let stored = record_of(&store, &claim).await.expect("recorded");
        assert_eq!(stored.status, 404);
        assert_eq!(stored.outcome, Finished::Failed);
    }
}

#[test]
fn a_status_reads_as_a_grpc_client_reads_it() {
    let headers = |value: &'static str| {
        let mut headers = HeaderMap::new();
        headers.insert("grpc-status", HeaderValue::from_static(value));
        headers
    };
    assert_eq!(super::status_in(&headers("14")), Some(14));
    assert_eq!(super::status_in(&headers("0")), Some(0));
    for unread in [" 14", "+0", "14 ", "", "-1", "1x", "99999999999"] {
        assert_eq!(super::status_in(&headers(unread)), None, "{unread:?}");
    }
}

#[test]
fn a_handlers_disposition_is_read_and_taken_off() {
    for (value, said) in [
        ("fail", Some(Disposition::Fail)),
        ("complete", Some(Disposition::Complete)),
        (" release ", Some(Disposition::Release)),
        ("maybe", None),
    ] {
        let mut headers = HeaderMap::new();
        headers.insert(DISPOSITION_METADATA, HeaderValue::from_static(value));
        assert_eq!(super::disposition_in(&mut headers), said, "{value:?}");
        assert!(headers.is_empty(), "taken off the answer");
    }
}
