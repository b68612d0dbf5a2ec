//! Settings declared once. [`settings!`] defines a struct whose every field carries its doc
//! and default in one place, and derives from that one declaration the struct, its
//! `Default`, serde (a missing key takes its default, an unknown key is an error) and a
//! [`Described`] schema: each field's name, doc, kind and default. The Python side builds
//! its config classes, CLI flags and TOML keys from the schema, so adding a setting is one
//! edit plus its doc.

use serde_json::{json, Value};

/// What a setting's value looks like, for the front ends that parse it.
pub trait Kind {
    /// `{"type": ...}` with `choices` for an enum and `nullable` for an option.
    fn kind() -> Value;
}

macro_rules! scalar_kind {
    ($($t:ty => $name:literal),* $(,)?) => {
        $(impl Kind for $t {
            fn kind() -> Value {
                json!({ "type": $name })
            }
        })*
    };
}

scalar_kind!(f64 => "float", u32 => "int", u64 => "int", bool => "bool", String => "str");

impl<T: Kind> Kind for Option<T> {
    fn kind() -> Value {
        let mut kind = T::kind();
        kind["nullable"] = json!(true);
        kind
    }
}

impl<T: Kind> Kind for Vec<T> {
    fn kind() -> Value {
        json!({ "type": "list", "item": T::kind() })
    }
}

/// A struct declared with [`settings!`]: its fields' schema.
pub trait Described {
    /// One object per field: `name`, `doc`, `kind` ([`Kind`]) and `default`; a field that
    /// is itself a settings struct has its own schema under `fields`.
    fn schema() -> Value;
}

/// Implements [`Kind`] and serde for a unit-variant enum named by its snake-case strings.
macro_rules! choice_enum {
    (
        $(#[doc = $doc:literal])*
        pub enum $name:ident {
            $($(#[doc = $vdoc:literal])* $variant:ident = $text:literal),+ $(,)?
        }
    ) => {
        $(#[doc = $doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
        pub enum $name {
            $($(#[doc = $vdoc])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            pub const NAMES: &'static [&'static str] = &[$($text),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }
        }

        impl $crate::settings::Kind for $name {
            fn kind() -> serde_json::Value {
                serde_json::json!({ "type": "choice", "choices": $name::NAMES })
            }
        }
    };
}

/// Declares a settings struct: `/// doc` then `pub name: Type = default,` per field.
/// A field marked `@nested` is itself a settings struct (its schema nests).
macro_rules! settings {
    (
        $(#[$meta:meta])*
        pub struct $name:ident {
            $(
                $(#[doc = $fdoc:literal])+
                $(@$nested:ident)?
                pub $field:ident: $ty:ty = $default:expr,
            )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
        #[serde(default, deny_unknown_fields)]
        pub struct $name {
            $($(#[doc = $fdoc])+ pub $field: $ty,)+
        }

        impl Default for $name {
            fn default() -> Self {
                Self { $($field: $default,)+ }
            }
        }

        impl $crate::settings::Described for $name {
            fn schema() -> serde_json::Value {
                let defaults = serde_json::to_value(Self::default())
                    .expect("settings serialise to JSON");
                serde_json::Value::Array(vec![$(
                    $crate::settings::settings!(@field $field, $ty, [$($fdoc)+], defaults, $($nested)?)
                ),+])
            }
        }
    };
    (@field $field:ident, $ty:ty, [$($fdoc:literal)+], $defaults:ident,) => {
        serde_json::json!({
            "name": stringify!($field),
            "doc": $crate::settings::doc_text(&[$($fdoc),+]),
            "kind": <$ty as $crate::settings::Kind>::kind(),
            "default": $defaults[stringify!($field)].clone(),
        })
    };
    (@field $field:ident, $ty:ty, [$($fdoc:literal)+], $defaults:ident, nested) => {
        serde_json::json!({
            "name": stringify!($field),
            "doc": $crate::settings::doc_text(&[$($fdoc),+]),
            "kind": { "type": "settings" },
            "fields": <$ty as $crate::settings::Described>::schema(),
            "default": $defaults[stringify!($field)].clone(),
        })
    };
}

pub(crate) use {choice_enum, settings};

/// A doc comment's lines as one paragraph.
pub fn doc_text(lines: &[&str]) -> String {
    lines
        .iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}
