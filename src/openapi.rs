//! The layer's contract in an OpenAPI document (feature `openapi`, on utoipa 6): what a client
//! must send and may get back on a guarded route is written into the operations the layer
//! guards, from the layer's own settings, so the document cannot say otherwise than the layer does.
//!
//! The rule: [`IdempotencyLayer::openapi`](crate::IdempotencyLayer::openapi) takes what the layer
//! is set to (key required or not, the methods it guards, the replay header's name, the expiry
//! header, the shortest key, `Retry-After`, whether the application renders the errors itself),
//! and [`IdempotencyOpenApi::document`] writes it into an [`OpenApi`] the application already has
//! (from `#[derive(OpenApi)]`, utoipa-axum's `OpenApiRouter::split_for_parts`, or the builder):
//!
//! - the `Idempotency-Key` header parameter, required as the layer is set, with the key's length
//!   and characters;
//! - one response for each status the layer answers with itself (400, 401, 408, 409, 413, 414,
//!   422, 429, 500, 503, 504), its error codes in its description, as `application/problem+json`
//!   of the [`PROBLEM_SCHEMA`] schema (added once under `components`) with an example for each
//!   code, and `Retry-After` on those that can be retried;
//! - the replay header, `Idempotency-Replay` and `Idempotency-Expires` on every 2xx response.
//!
//! Why this cut: the layer sits on some routes and not others, and only it knows its settings, so
//! it is asked for its description
//! ([`IdempotencyLayer::openapi`](crate::IdempotencyLayer::openapi)) and that description is
//! applied to a whole document, as a utoipa [`Modify`] is, limited to the layer's routes with
//! [`paths`](IdempotencyOpenApi::paths). A route's own documentation is kept: what it already says
//! (a response of the same status, a header of the same name, a reference) stays, the layer's media
//! type and headers are added beside it, and applying the description twice changes nothing. Where
//! the operation answers `application/problem+json` of its own with a status the layer also answers
//! with, the schema becomes either of the two (`anyOf`). Only a hand-written `Idempotency-Key`
//! parameter is replaced, by what the layer enforces. The schema is named `IdempotencyProblem`, not
//! `Problem`, so that an application's own is left as it is.
//!
//! ```
//! use axum_idempotency::{IdempotencyLayer, MemoryStore};
//! use axum_idempotency::utoipa::openapi::{HttpMethod, Info, OpenApi, PathItem, PathsBuilder};
//! use axum_idempotency::utoipa::openapi::path::Operation;
//! use axum_idempotency::utoipa::openapi::response::Response;
//!
//! let layer = IdempotencyLayer::builder(MemoryStore::new()).require_key(true).build()?;
//! let mut checkout = Operation::new();
//! checkout.responses.responses.insert("201".into(), Response::new("Charged").into());
//! let mut openapi = OpenApi::new(
//!     Info::new("Checkout", "1.0.0"),
//!     PathsBuilder::new()
//!         .path("/checkout", PathItem::new(HttpMethod::Post, checkout))
//!         .build(),
//! );
//! let documented = layer.openapi().paths(["/checkout"]).document(&mut openapi);
//! assert_eq!(documented, 1);
//! # let post = openapi.paths.paths["/checkout"].post.as_ref().expect("post");
//! # assert!(post.responses.responses.contains_key("409"));
//! # Ok::<(), axum_idempotency::ConfigError>(())
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;

use http::{Method, StatusCode};
use serde_json::Value;
use utoipa::Modify;
use utoipa::openapi::example::ExampleBuilder;
use utoipa::openapi::header::HeaderBuilder;
use utoipa::openapi::path::{Operation, Parameter, ParameterBuilder, ParameterIn, PathItem};
use utoipa::openapi::response::{Response, ResponseBuilder};
use utoipa::openapi::schema::{AllOfBuilder, AnyOfBuilder, ObjectBuilder, SchemaFormat, Type};
use utoipa::openapi::{Components, ContentBuilder, OpenApi, Ref, RefOr, Required, Schema};

use crate::ErrorKind;
use crate::header::{IDEMPOTENCY_EXPIRES, IDEMPOTENCY_KEY, IDEMPOTENCY_REPLAY};
use crate::layer::key::{KeySource, MAX_KEY_LEN};
use crate::layer::{LayerSettings, guards};

/// The name, under `components/schemas`, of the schema of the layer's error answers.
pub const PROBLEM_SCHEMA: &str = "IdempotencyProblem";

/// The media type of the layer's error answers.
const PROBLEM_JSON: &str = "application/problem+json";

/// A key as a client should send it: visible ASCII, spaces inside only, and not starting with a
/// double quote (the layer reads such a value as a quoted string, the same key as its content:
/// documenting only the bare form keeps every documented key the key it says).
pub(crate) const KEY_PATTERN: &str = "^[!#-~]([ -~]*[!-~])?$";

/// An `instance` for the examples.
const EXAMPLE_INSTANCE: &str = "urn:uuid:5f0c6e0d-9a4b-4c8e-8b1f-2a3d4c5e6f70";

/// What one [`IdempotencyLayer`](crate::IdempotencyLayer) is set to, to write into an OpenAPI
/// document: made by [`IdempotencyLayer::openapi`](crate::IdempotencyLayer::openapi). See the
/// [module](self) for what it adds.
#[derive(Debug, Clone)]
pub struct IdempotencyOpenApi {
    settings: Arc<LayerSettings>,
    /// The paths the layer is on; `None`: every path.
    paths: Option<Vec<String>>,
}

impl IdempotencyOpenApi {
    pub(crate) fn new(settings: Arc<LayerSettings>) -> Self {
        IdempotencyOpenApi {
            settings,
            paths: None,
        }
    }

    /// Only the operations of these paths, as the document writes them (`/orders/{id}`): the
    /// routes the layer is on. Without it, every path of the document (a layer on the whole
    /// router).
    pub fn paths<I, S>(mut self, paths: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.paths = Some(paths.into_iter().map(Into::into).collect());
        self
    }

    /// Documents every operation of `openapi` whose method the layer guards (on the
    /// [`paths`](Self::paths) given), and adds the [`PROBLEM_SCHEMA`] schema they refer to.
    /// Operations of methods the layer passes through (`GET`, `HEAD`, ...) are left alone.
    ///
    /// Returns how many operations it documented: none means a path not written as the document
    /// writes it, or no method the layer guards.
    pub fn document(&self, openapi: &mut OpenApi) -> usize {
        let mut documented = 0;
        for (path, item) in &mut openapi.paths.paths {
            if let Some(only) = &self.paths
                && !only.iter().any(|p| p == path)
            {
                continue;
            }
            for (method, operation) in guarded_slots(item) {
                if let Some(operation) = operation
                    && guards(&self.settings, &method)
                {
                    self.operation(operation);
                    documented += 1;
                }
            }
        }
        if documented > 0 {
            self.components(openapi.components.get_or_insert_with(Components::new));
        }
        documented
    }

    /// Documents `operation` as one the layer guards (whatever its method: the caller says it is
    /// guarded), and adds the [`PROBLEM_SCHEMA`] schema it refers to to `components`.
    pub fn document_operation(&self, operation: &mut Operation, components: &mut Components) {
        self.operation(operation);
        self.components(components);
    }

    fn components(&self, components: &mut Components) {
        if !self.settings.problems.is_rendered() {
            components
                .schemas
                .entry(PROBLEM_SCHEMA.to_owned())
                .or_insert_with(|| RefOr::T(problem_schema()));
        }
    }

    fn operation(&self, operation: &mut Operation) {
        if let KeySource::Body(pointer, _) = &self.settings.key_source {
            self.key_in_body(operation, pointer);
        } else {
            self.key_in_headers(operation);
        }
        for (status, kinds) in self.problems() {
            let answer = self.problem_response(status, &kinds);
            match operation.responses.responses.get_mut(status.as_str()) {
                None => {
                    operation
                        .responses
                        .responses
                        .insert(status.as_str().to_owned(), RefOr::T(answer));
                }
                // The operation's own answer of that status keeps its description; the layer's
                // media type and `Retry-After` are added to it. A reference is left as it is.
                Some(RefOr::T(existing)) => merge(existing, answer),
                Some(RefOr::Ref(_)) => {}
            }
        }
        for (status, response) in &mut operation.responses.responses {
            if let (true, RefOr::T(response)) = (status.starts_with('2'), response) {
                self.success_headers(response);
            }
        }
    }

    /// The key's header parameter: the layer's header (and, when it reads another one or uses an
    /// extractor, the draft's `Idempotency-Key` too, which it also takes).
    fn key_in_headers(&self, operation: &mut Operation) {
        let parameters = operation.parameters.get_or_insert_with(Vec::new);
        let name = match &self.settings.key_source {
            KeySource::Header(name) => title_case(name.as_str()),
            _ => title_case(IDEMPOTENCY_KEY.as_str()),
        };
        let key = self.key_parameter(name);
        let written = parameters.iter_mut().find(|p| {
            matches!(p, RefOr::T(p) if p.parameter_in == ParameterIn::Header
                && p.name.eq_ignore_ascii_case(&key.name))
        });
        match written {
            // The layer's rule wins over what was written by hand: it is what is enforced.
            Some(existing) => *existing = RefOr::T(key),
            None => parameters.push(RefOr::T(key)),
        }
    }

    /// The key as a field of the JSON request body: the body's schema becomes all of what it was
    /// and an object holding the field (nested as the pointer says), required when the layer
    /// requires a key.
    fn key_in_body(&self, operation: &mut Operation, pointer: &str) {
        let mut schema: RefOr<Schema> = RefOr::T(Schema::Object(self.key_schema().build()));
        let tokens: Vec<String> = pointer
            .strip_prefix('/')
            .unwrap_or(pointer)
            .split('/')
            .map(|t| t.replace("~1", "/").replace("~0", "~"))
            .collect();
        for token in tokens.iter().rev() {
            let mut object = ObjectBuilder::new()
                .schema_type(Type::Object)
                .property(token.as_str(), schema);
            if self.settings.require_key {
                object = object.required(token.as_str());
            }
            schema = RefOr::T(Schema::Object(object.build()));
        }
        if let RefOr::T(Schema::Object(object)) = &mut schema {
            object.description = Some(format!(
                "The idempotency key is the field `{pointer}` of this body: {}",
                self.key_description()
            ));
        }
        let body = operation
            .request_body
            .get_or_insert_with(|| RefOr::T(utoipa::openapi::request_body::RequestBody::new()));
        // A body described by reference is left as it is: its component is shared.
        let RefOr::T(body) = body else {
            return;
        };
        let content = body
            .content
            .entry("application/json".to_owned())
            .or_insert_with(|| RefOr::T(ContentBuilder::new().build()));
        let RefOr::T(content) = content else {
            return;
        };
        content.schema = Some(match content.schema.take() {
            None => schema,
            Some(existing) => RefOr::T(Schema::AllOf(
                AllOfBuilder::new().item(existing).item(schema).build(),
            )),
        });
    }

    fn key_description(&self) -> &'static str {
        if self.settings.require_key {
            "Required. One key per operation: a retry of the same request sends the same key and \
             gets the first answer again, never a second effect. Without it the answer is \
             `400 missing_idempotency_key`."
        } else {
            "One key per operation: a retry of the same request sends the same key and gets the \
             first answer again, never a second effect. Without it the request runs unguarded."
        }
    }

    fn key_schema(&self) -> ObjectBuilder {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .min_length(Some(self.settings.min_key_length))
            .max_length(Some(MAX_KEY_LEN))
            .pattern(Some(KEY_PATTERN))
            .examples(["8e03978e-40d5-43e8-bc93-6894a57f9324"])
    }

    fn key_parameter(&self, name: String) -> Parameter {
        let description = self.key_description();
        let schema = self.key_schema();
        ParameterBuilder::new()
            .name(name)
            .parameter_in(ParameterIn::Header)
            .required(if self.settings.require_key {
                Required::True
            } else {
                Required::False
            })
            .description(Some(description))
            .schema(Some(schema))
            .build()
    }

    /// The layer's own error answers on a guarded route, by status.
    fn problems(&self) -> BTreeMap<StatusCode, Vec<ErrorKind>> {
        let mut by_status = BTreeMap::<StatusCode, Vec<ErrorKind>>::new();
        for kind in ErrorKind::ALL {
            if kind == ErrorKind::MissingIdempotencyKey && !self.settings.require_key {
                continue;
            }
            if kind == ErrorKind::KeyExpired && !self.settings.tombstones {
                continue;
            }
            by_status.entry(kind.status()).or_default().push(kind);
        }
        by_status
    }

    fn problem_response(&self, status: StatusCode, kinds: &[ErrorKind]) -> Response {
        let codes = kinds
            .iter()
            .map(|kind| format!("`{}` ({})", kind.code(), kind.title()))
            .collect::<Vec<_>>()
            .join("; ");
        let reason = status.canonical_reason().unwrap_or("Error");
        let retry = kinds.iter().any(|kind| kind.may_retry());
        let mut description = format!("{reason}, answered by the idempotency layer: {codes}.");
        if retry {
            description.push_str(
                " When `retryable` is true, send the same request with the same key again after \
                 `Retry-After` seconds.",
            );
        }
        let mut response = ResponseBuilder::new().description(description);
        if !self.settings.problems.is_rendered() {
            let mut content = ContentBuilder::new()
                .schema(Some(Ref::from_schema_name(PROBLEM_SCHEMA)))
                .build();
            for kind in kinds {
                if let Some(value) = self.example(*kind) {
                    let example = ExampleBuilder::new()
                        .summary(kind.title())
                        .value(Some(value))
                        .build();
                    content
                        .examples
                        .insert(kind.code().to_owned(), RefOr::T(example));
                }
            }
            response = response.content(PROBLEM_JSON, content);
        }
        if retry {
            let seconds = ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(1))
                .examples([self.settings.retry_after_secs]);
            let header = HeaderBuilder::new()
                .schema(Some(seconds))
                .description(Some(
                    "Seconds to wait before sending the same request with the same key again; \
                     sent with every retryable answer.",
                ))
                .build();
            response = response.header(title_case(http::header::RETRY_AFTER.as_str()), header);
        }
        response.build()
    }

    /// The problem document the layer sends for `kind`, as an example.
    fn example(&self, kind: ErrorKind) -> Option<Value> {
        // A handler timeout is retryable only on the transactional path: shown as it usually is.
        let retry = (kind.may_retry() && kind != ErrorKind::HandlerTimeout)
            .then_some(self.settings.retry_after_secs);
        let body = self
            .settings
            .problems
            .body(kind, kind.title(), retry, EXAMPLE_INSTANCE);
        serde_json::from_str(&body).ok()
    }

    fn success_headers(&self, response: &mut Response) {
        let string = || ObjectBuilder::new().schema_type(Type::String);
        let replayed = HeaderBuilder::new()
            .schema(Some(string().enum_values(Some(["true"]))))
            .description(Some(
                "`true` when this is the recorded answer of an earlier request with the same key, \
                 sent again; absent on the first answer.",
            ))
            .build();
        add_header(
            response,
            &title_case(self.settings.replay_header.as_str()),
            replayed,
        );
        let omitted = HeaderBuilder::new()
            .schema(Some(string().enum_values(Some(["omitted"]))))
            .description(Some(
                "`omitted` on a replay whose body was not recorded (too large, or its stream \
                 failed): status and headers are the first answer's, the body is empty.",
            ))
            .build();
        add_header(response, &title_case(IDEMPOTENCY_REPLAY.as_str()), omitted);
        if self.settings.expiry_header {
            let expires = HeaderBuilder::new()
                .schema(Some(string().examples(["Sun, 06 Nov 1994 08:49:37 GMT"])))
                .description(Some(
                    "When the key's record expires (an HTTP date): until then a retry with the key \
                     gets this answer again; from then on the key is new.",
                ))
                .build();
            add_header(response, &title_case(IDEMPOTENCY_EXPIRES.as_str()), expires);
        }
    }
}

impl Modify for IdempotencyOpenApi {
    /// [`IdempotencyOpenApi::document`].
    fn modify(&self, openapi: &mut OpenApi) {
        let _documented = self.document(openapi);
    }
}

/// The operations of a path item whose methods the layer can guard (the safe ones it cannot).
fn guarded_slots(item: &mut PathItem) -> [(Method, &mut Option<Operation>); 4] {
    [
        (Method::POST, &mut item.post),
        (Method::PUT, &mut item.put),
        (Method::PATCH, &mut item.patch),
        (Method::DELETE, &mut item.delete),
    ]
}

/// Adds the layer's answer to one of the operation's own of the same status: its media type, or
/// beside the operation's own problem schema (either may answer), its examples and its headers.
fn merge(existing: &mut Response, answer: Response) {
    for (media, content) in answer.content {
        let Some(own) = existing.content.get_mut(&media) else {
            existing.content.insert(media, content);
            continue;
        };
        // A media type written as a reference to a shared content is left as it is.
        let (RefOr::T(own), RefOr::T(content)) = (own, content) else {
            continue;
        };
        own.schema = match own.schema.take() {
            None => content.schema,
            Some(schema) if refers_to_problem(&schema) => Some(schema),
            Some(schema) => {
                let either = AnyOfBuilder::new()
                    .item(schema)
                    .item(Ref::from_schema_name(PROBLEM_SCHEMA));
                Some(RefOr::T(Schema::AnyOf(either.build())))
            }
        };
        for (code, example) in content.examples {
            own.examples.entry(code).or_insert(example);
        }
    }
    for (name, header) in answer.headers {
        add_header(existing, &name, header);
    }
}

/// Whether `schema` is the layer's problem schema, or has it as one of its choices.
fn refers_to_problem(schema: &RefOr<Schema>) -> bool {
    let problem = Ref::from_schema_name(PROBLEM_SCHEMA).ref_location;
    let is_problem =
        |schema: &RefOr<Schema>| matches!(schema, RefOr::Ref(r) if r.ref_location == problem);
    match schema {
        RefOr::T(Schema::AnyOf(any)) => any.items.iter().any(is_problem),
        schema => is_problem(schema),
    }
}

/// Adds `header` unless the response has one of that name (header names ignore case).
fn add_header(
    response: &mut Response,
    name: &str,
    header: impl Into<RefOr<utoipa::openapi::header::Header>>,
) {
    if !response
        .headers
        .keys()
        .any(|existing| existing.eq_ignore_ascii_case(name))
    {
        response.headers.insert(name.to_owned(), header.into());
    }
}

/// `idempotency-key` as documents write it: `Idempotency-Key`.
fn title_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut start = true;
    for c in name.chars() {
        out.push(if start { c.to_ascii_uppercase() } else { c });
        start = c == '-';
    }
    out
}

/// The schema of the layer's error answers: problem details (RFC 9457) and the layer's members.
fn problem_schema() -> Schema {
    let string = |description: &str| {
        ObjectBuilder::new()
            .schema_type(Type::String)
            .description(Some(description))
    };
    let uri =
        |description: &str| string(description).format(Some(SchemaFormat::Custom("uri".into())));
    let codes = ErrorKind::ALL
        .iter()
        .map(|kind| format!("`{}`", kind.code()))
        .collect::<Vec<_>>()
        .join(", ");
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some(
            "An error answered by the idempotency layer itself: problem details (RFC 9457) with a \
             stable `error` code and whether the same request with the same key may be sent again.",
        ))
        .property("type", uri("An absolute URI documenting the error."))
        .property("title", string("A short summary of the error."))
        .property(
            "status",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(400))
                .maximum(Some(599))
                .description(Some("The HTTP status of the answer.")),
        )
        .property("detail", string("What happened, for a person."))
        .property(
            "error",
            string(&format!(
                "The stable machine code; more may be added. Today: {codes}."
            )),
        )
        .property(
            "instance",
            uri("Unique to this occurrence and logged with it by the server."),
        )
        .property(
            "retryable",
            ObjectBuilder::new().schema_type(Type::Boolean).description(Some(
                "Whether sending the same request with the same key again can succeed; when true \
                 the answer has `Retry-After`.",
            )),
        )
        .property(
            "retryAfterSeconds",
            ObjectBuilder::new()
                .schema_type(Type::Integer)
                .minimum(Some(1))
                .description(Some("On `in_progress` only: the `Retry-After` value.")),
        )
        .required("type")
        .required("title")
        .required("status")
        .required("detail")
        .required("error")
        .required("instance")
        .required("retryable")
        .build()
        .into()
}

#[cfg(test)]
mod tests;
