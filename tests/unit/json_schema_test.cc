// JSON Schema -> Grammar (models/constraints/json_schema.h) and the Matcher over it
// (models/constraints/matcher.h): each keyword's accepted and refused documents, the
// bounds, and the compile errors naming keyword and pointer.
#include "models/constraints/json_schema.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/hash/hash.h"
#include "absl/strings/str_cat.h"
#include "models/constraints/matcher.h"

namespace fwserve::constraints {
namespace {

using Json = nlohmann::ordered_json;

std::shared_ptr<const Grammar> Compile(const std::string& schema,
                                       const JsonSchemaOptions& options = {}) {
  auto g = CompileJsonSchema(Json::parse(schema), options);
  EXPECT_TRUE(g.ok()) << schema << ": " << g.status();
  return g.ok() ? *g : nullptr;
}

// The whole of `doc` is a complete document.
bool Accepts(const std::shared_ptr<const Grammar>& g, const std::string& doc) {
  Matcher m(g);
  return m.AdvanceBytes(doc) && m.IsComplete();
}

std::string CompileError(const std::string& schema) {
  auto g = CompileJsonSchema(Json::parse(schema));
  EXPECT_FALSE(g.ok()) << schema;
  if (!g.ok()) {
    EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  }
  return g.ok() ? "" : std::string(g.status().message());
}

void ExpectAll(const std::shared_ptr<const Grammar>& g, const std::vector<std::string>& good,
               const std::vector<std::string>& bad) {
  ASSERT_NE(g, nullptr);
  for (const auto& doc : good) EXPECT_TRUE(Accepts(g, doc)) << "should accept: " << doc;
  for (const auto& doc : bad) EXPECT_FALSE(Accepts(g, doc)) << "should refuse: " << doc;
}

TEST(JsonSchemaTest, Primitives) {
  ExpectAll(Compile(R"({"type":"string"})"),
            {R"("")", R"("abc")", R"("a\"b\\c\/\b\f\n\r\t")", R"("\u00e9\uD83D\uDE00")",
             "\"\xC3\xA9\xF0\x9F\x98\x80\""},
            {"abc", R"("abc)", R"("a"b")", "\"a\nb\"", R"("\x")", R"("\uD83D")", R"("\uDE00")",
             R"("\u12G4")", "\"\xC3\"", "\"\xC0\xAF\"", "\"\xED\xA0\x80\"", "\"\xF4\x90\x80\x80\"",
             R"( "a")", R"("a" )"});
  ExpectAll(Compile(R"({"type":"boolean"})"), {"true", "false"}, {"True", "tru", "1", "null"});
  ExpectAll(Compile(R"({"type":"null"})"), {"null"}, {"nul", "false", "\"null\""});
  ExpectAll(Compile(R"({"type":"integer"})"), {"0", "-0", "7", "-12", "1234567890123456"},
            {"01", "1.0", "1e3", "+1", "-", "12345678901234567", "--1"});
  ExpectAll(Compile(R"({"type":"number"})"),
            {"0", "-0.5", "3.25", "1e5", "1E+05", "2.5e-3", "1234567890123456.1234567890123456"},
            {".5", "1.", "1e", "01.5", "1.2.3", "1e123", "1.12345678901234567"});
  ExpectAll(Compile(R"({"type":["string","null"]})"), {"null", R"("x")"}, {"1", "nul"});
  ExpectAll(Compile(R"({"type":["integer","number"]})"), {"1", "1.5"}, {"\"1\""});
}

TEST(JsonSchemaTest, NumberDigitBoundsAreOptions) {
  JsonSchemaOptions o;
  o.max_integer_digits = 3;
  o.max_fraction_digits = 2;
  o.max_exponent_digits = 1;
  ExpectAll(Compile(R"({"type":"number"})", o), {"999", "-1.25", "1e9", "12.5E-3"},
            {"1000", "1.125", "1e10", "1e+12"});
  o.max_fraction_digits = 0;
  o.max_exponent_digits = 0;
  ExpectAll(Compile(R"({"type":"number"})", o), {"12"}, {"1.5", "1e2"});
}

TEST(JsonSchemaTest, CompleteAndFinished) {
  auto number = Compile(R"({"type":"integer"})");
  Matcher m(number);
  EXPECT_FALSE(m.IsComplete());
  ASSERT_TRUE(m.AdvanceBytes("12"));
  EXPECT_TRUE(m.IsComplete());
  EXPECT_FALSE(m.IsFinished());  // more digits may follow
  ASSERT_TRUE(m.AdvanceBytes("34567890123456"));
  EXPECT_TRUE(m.IsFinished());  // 16 digits: the bound
  EXPECT_TRUE(m.NextBytes().none());

  auto object = Compile(R"({"type":"object","properties":{"a":{"type":"integer"}}})");
  Matcher o(object);
  ASSERT_TRUE(o.AdvanceBytes(R"({"a":1)"));
  EXPECT_FALSE(o.IsComplete());
  ASSERT_TRUE(o.Advance('}'));
  EXPECT_TRUE(o.IsComplete());
  EXPECT_TRUE(o.IsFinished());  // no trailing whitespace
  EXPECT_FALSE(o.Accepts(' '));
  EXPECT_FALSE(o.Accepts('\n'));
}

TEST(JsonSchemaTest, MatcherAdvanceIsAllOrNothing) {
  auto g = Compile(R"({"type":"object","properties":{"name":{"type":"string"}},
                       "required":["name"],"additionalProperties":false})");
  Matcher m(g);
  const Matcher start = m;
  EXPECT_FALSE(m.Advance('['));
  EXPECT_TRUE(m == start);
  EXPECT_FALSE(m.AdvanceBytes(R"({"nam!)"));
  EXPECT_TRUE(m == start);  // nothing consumed
  ASSERT_TRUE(m.AdvanceBytes(R"({"na)"));
  EXPECT_FALSE(m == start);
  const std::bitset<256> next = m.NextBytes();
  EXPECT_EQ(next.count(), 1u);
  EXPECT_TRUE(next['m']);
  EXPECT_TRUE(m.Accepts('m'));
  EXPECT_FALSE(m.Accepts('x'));

  // Copies are independent; equal positions compare and hash equal.
  Matcher a = m, b = m;
  ASSERT_TRUE(a.AdvanceBytes(R"(me":"x)"));
  EXPECT_TRUE(b == m);
  ASSERT_TRUE(b.AdvanceBytes(R"(me":"x)"));
  EXPECT_TRUE(a == b);
  EXPECT_EQ(absl::HashOf(a), absl::HashOf(b));
  ASSERT_TRUE(a.Advance('y'));
  ASSERT_TRUE(b.Advance('z'));
  EXPECT_TRUE(a == b);  // inside the string either letter leads to the same state
  ASSERT_TRUE(a.AdvanceBytes("\"}"));
  EXPECT_TRUE(a.IsFinished());
  EXPECT_FALSE(b.IsComplete());
}

TEST(JsonSchemaTest, ObjectsInDeclarationOrder) {
  auto g = Compile(R"({"type":"object","properties":{
      "b":{"type":"integer"},"a":{"type":"string"},"c":{"type":"boolean"}},
      "required":["a"],"additionalProperties":false})");
  ExpectAll(g,
            {R"({"a":"x"})", R"({"b":1,"a":"x"})", R"({"b":1,"a":"x","c":true})",
             R"({"a":"x","c":false})", R"({ "b": 1, "a": "x" })", "{\"a\":\"x\"\n}",
             R"({  "a"  :  "x"  })"},
            {R"({})", R"({"b":1})", R"({"a":"x","b":1})", R"({"a":"x",})", R"({"a":"x","d":1})",
             R"({"a":1})", R"({"a":"x""c":true})", R"({,"a":"x"})", R"({   "a":"x"})",
             R"({"a":"x","a":"y"})"});
  // nlohmann::json (a std::map) iterates alphabetically: that is the order then.
  auto sorted = CompileJsonSchema(nlohmann::json::parse(R"({"type":"object","properties":{
      "b":{"type":"integer"},"a":{"type":"string"}},"additionalProperties":false})"));
  ASSERT_TRUE(sorted.ok()) << sorted.status();
  ExpectAll(*sorted, {R"({"a":"x","b":1})"}, {R"({"b":1,"a":"x"})"});
}

TEST(JsonSchemaTest, AdditionalProperties) {
  // Absent = true: any other key, any value, after the declared ones.
  auto open = Compile(R"({"type":"object","properties":{"a":{"type":"integer"}}})");
  ExpectAll(open,
            {R"({})", R"({"a":1})", R"({"a":1,"x":[1,{"y":null}]})", R"({"zz":"q","ab":2})",
             R"({"":{}})"},
            {R"({"a":"s"})", R"({"x":1,"a":1})", R"({"a":1,"a":2})", R"({"x\"y":1})"});
  auto typed = Compile(R"({"type":"object","additionalProperties":{"type":"integer"}})");
  ExpectAll(typed, {R"({})", R"({"k":1,"l":-2})"}, {R"({"k":"v"})", R"({"k":1.5})"});
  auto closed = Compile(R"({"type":"object","additionalProperties":false})");
  ExpectAll(closed, {"{}", "{ }"}, {R"({"a":1})"});
  // A property schema `false` may not appear; a required one not in properties takes the
  // additionalProperties schema.
  ExpectAll(Compile(R"({"type":"object","properties":{"a":false},"required":["b"],
                        "additionalProperties":{"type":"string"}})"),
            {R"({"b":"x"})", R"({"b":"x","c":"y"})"}, {R"({})", R"({"a":"x","b":"x"})"});
  // A schema without "type" but with properties is an object.
  ExpectAll(Compile(R"({"properties":{"a":{"const":1}},"required":["a"]})"), {R"({"a":1})"},
            {"1", R"({"a":2})"});
}

TEST(JsonSchemaTest, Arrays) {
  ExpectAll(Compile(R"({"type":"array","items":{"type":"integer"}})"),
            {"[]", "[ ]", "[1]", "[1,2,3]", "[ 1 , 2 ]"}, {"[1,]", "[,1]", "[\"a\"]", "[1 2]"});
  ExpectAll(Compile(R"({"type":"array","items":{"type":"integer"},"minItems":2,"maxItems":3})"),
            {"[1,2]", "[1,2,3]"}, {"[]", "[1]", "[1,2,3,4]"});
  ExpectAll(Compile(R"({"type":"array","prefixItems":[{"type":"string"},{"type":"integer"}],
                        "items":false})"),
            {"[]", R"(["a"])", R"(["a",1])"}, {R"([1])", R"(["a",1,2])"});
  ExpectAll(Compile(R"({"type":"array","prefixItems":[{"type":"string"}],
                        "items":{"type":"boolean"},"minItems":2})"),
            {R"(["a",true])", R"(["a",true,false])"}, {R"(["a"])", R"(["a",1])"});
  ExpectAll(Compile(R"({"type":"array"})"), {"[]", R"([1,"a",[null,{}]])"}, {"[", "{}"});
  // A large item schema repeated by the bounds is called, not copied.
  ExpectAll(Compile(R"({"type":"array","minItems":1,"maxItems":40,"items":{"type":"object",
      "properties":{"id":{"type":"integer"},"name":{"type":"string","maxLength":20}},
      "required":["id","name"],"additionalProperties":false}})"),
            {R"([{"id":1,"name":"a"}])", R"([{"id":1,"name":"a"},{"id":2,"name":""}])"},
            {"[]", R"([{"id":1}])"});
}

TEST(JsonSchemaTest, EnumConstAndUnions) {
  ExpectAll(Compile(R"({"enum":["red","green",3,null,{"a":[1,2]},true]})"),
            {R"("red")", R"("green")", "3", "null", R"({"a":[1,2]})", "true"},
            {R"("blue")", R"("re")", "4", R"({"a":[1, 2]})", "false"});
  ExpectAll(Compile(R"({"type":"string","enum":["a","b",1]})"), {R"("a")", R"("b")"}, {"1"});
  ExpectAll(Compile(R"({"const":"tab\tquote\""})"), {R"("tab\tquote\"")"}, {"\"tab\tquote\\\"\""});
  ExpectAll(Compile(R"({"anyOf":[{"type":"object","properties":{"kind":{"const":"a"},
                        "x":{"type":"integer"}},"required":["kind","x"],
                        "additionalProperties":false},{"type":"object","properties":{
                        "kind":{"const":"b"},"y":{"type":"string"}},"required":["kind","y"],
                        "additionalProperties":false}]})"),
            {R"({"kind":"a","x":1})", R"({"kind":"b","y":"s"})"},
            {R"({"kind":"a","y":"s"})", R"({"kind":"b","x":1})"});
  ExpectAll(Compile(R"({"oneOf":[{"type":"integer"},{"type":"string"}]})"), {"1", R"("s")"},
            {"true"});
  ExpectAll(Compile(R"({"allOf":[{"type":"integer"}],"description":"d"})"), {"1"}, {"\"1\""});
  ExpectAll(Compile(R"({"anyOf":[{"type":"string"},{"type":"null"}]})"), {"null", R"("a")"}, {"1"});
  ExpectAll(Compile(R"({"type":"integer","nullable":true})"), {"null", "1"}, {"\"1\""});
  ExpectAll(Compile(R"({"enum":["a"],"nullable":true})"), {"null", R"("a")"}, {"\"b\""});
}

TEST(JsonSchemaTest, RefsAndRecursion) {
  auto tree = Compile(R"({"$defs":{"node":{"type":"object","properties":{
      "value":{"type":"integer"},"children":{"type":"array","items":{"$ref":"#/$defs/node"}}},
      "required":["value","children"],"additionalProperties":false}},
      "$ref":"#/$defs/node"})");
  ExpectAll(tree,
            {R"({"value":1,"children":[]})",
             R"({"value":1,"children":[{"value":2,"children":[{"value":3,"children":[]}]},)"
             R"({"value":4,"children":[]}]})"},
            {R"({"value":1})", R"({"value":1,"children":[{"value":2}]})",
             R"({"value":1,"children":[]}})"});
  // definitions, #, and a list through the root.
  ExpectAll(Compile(R"({"type":"object","properties":{"next":{"anyOf":[{"$ref":"#"},
                        {"type":"null"}]}},"required":["next"],"additionalProperties":false})"),
            {R"({"next":null})", R"({"next":{"next":{"next":null}}})"}, {R"({"next":{}})", "null"});
  ExpectAll(Compile(R"({"definitions":{"a":{"type":"string"}},"type":"array",
                        "items":{"$ref":"#/definitions/a"}})"),
            {R"(["x","y"])"}, {"[1]"});
  // Mutual recursion.
  ExpectAll(Compile(R"({"$defs":{"a":{"type":"array","items":{"$ref":"#/$defs/b"}},
                        "b":{"anyOf":[{"type":"integer"},{"$ref":"#/$defs/a"}]}},
                        "$ref":"#/$defs/a"})"),
            {"[]", "[1,[2,[3,[]]]]"}, {"[[[\"x\"]]]"});
}

TEST(JsonSchemaTest, LargeDefinitionsReferencedTwiceAreCalled) {
  // The first reference inlines the definition; later ones call it once it is large.
  std::string props;
  for (int i = 0; i < 12; ++i) {
    props += absl::StrCat(i ? "," : "", "\"p", i, "\":{\"type\":\"string\",\"maxLength\":4}");
  }
  auto g = Compile(absl::StrCat(R"({"$defs":{"big":{"type":"object","properties":{)", props,
                                R"(},"additionalProperties":false}},"type":"object",
                                "properties":{"a":{"$ref":"#/$defs/big"},"b":{"$ref":"#/$defs/big"},
                                "c":{"type":"array","items":{"$ref":"#/$defs/big"}}},
                                "required":["a","b","c"],"additionalProperties":false})"));
  ExpectAll(g, {R"({"a":{},"b":{"p3":"x"},"c":[{"p0":"abcd","p11":""},{}]})"},
            {R"({"a":{},"b":{"p3":"xxxxx"},"c":[]})", R"({"a":{},"b":{},"c":[{"q":1}]})",
             R"({"a":{},"b":{}})"});
}

TEST(JsonSchemaTest, RecursionDepthIsBounded) {
  JsonSchemaOptions o;
  o.max_recursion_depth = 4;
  auto g = Compile(R"({"$defs":{"a":{"type":"array","items":{"$ref":"#/$defs/a"}}},
                       "$ref":"#/$defs/a"})",
                   o);
  // The root rule calls a, and each nested array is a call: 3 levels fit in 4 frames.
  EXPECT_TRUE(Accepts(g, "[[[]]]"));
  EXPECT_FALSE(Accepts(g, "[[[[[]]]]]"));
  Matcher m(g);
  ASSERT_TRUE(m.AdvanceBytes("[[["));
  EXPECT_FALSE(m.NextBytes()['[']);
  EXPECT_FALSE(m.Accepts('['));
  EXPECT_TRUE(m.NextBytes()[']']);
}

TEST(JsonSchemaTest, StringLengthCountsCodePoints) {
  auto g = Compile(R"({"type":"string","minLength":2,"maxLength":3})");
  ExpectAll(g,
            {R"("ab")", R"("abc")", "\"\xC3\xA9\xC3\xA9\xC3\xA9\"", R"("\u00e9\n")",
             R"("a\uD83D\uDE00")"},
            {R"("a")", R"("abcd")", "\"\xC3\xA9\"", R"("\n\n\n\n")"});
}

TEST(JsonSchemaTest, Patterns) {
  ExpectAll(Compile(R"({"type":"string","pattern":"^[a-z]{2,4}-\\d+$"})"),
            {R"("ab-1")", R"("abcd-123")"}, {R"("a-1")", R"("abcde-1")", R"("ab-")", R"("AB-1")"});
  // Unanchored: a match anywhere.
  ExpectAll(Compile(R"({"type":"string","pattern":"cat|dog"})"),
            {R"("cat")", R"("a dog!")", R"("concatenate")"}, {R"("cow")", R"("")"});
  ExpectAll(Compile(R"({"type":"string","pattern":"^(?:ab)*c?$"})"),
            {R"("")", R"("abab")", R"("abc")"}, {R"("aba")", R"("cc")"});
  ExpectAll(Compile(R"({"type":"string","pattern":"^[^\\s]+$","maxLength":3})"),
            {R"("a-b")", "\"\xC3\xA9\""}, {R"("a b")", R"("abcd")", R"("")"});
  // Characters JSON escapes come out escaped, once each way.
  ExpectAll(Compile(R"({"type":"string","pattern":"^\"[\\\\]\n$"})"), {R"("\"\\\n")"},
            {R"("\u0022\\\n")"});
  ExpectAll(Compile(R"({"type":"string","pattern":"^.$"})"), {R"("x")", "\"\xE2\x82\xAC\""},
            {R"("\n")", R"("xy")"});
}

TEST(JsonSchemaTest, Formats) {
  ExpectAll(Compile(R"({"type":"string","format":"date"})"),
            {R"("2024-02-29")", R"("2000-02-29")", R"("2023-12-31")", R"("2023-04-30")"},
            {R"("2024-13-01")", R"("2024-1-01")", R"("24-01-01")", R"("2023-02-29")",
             R"("1900-02-29")", R"("2023-04-31")", R"("2023-02-30")"});
  ExpectAll(Compile(R"({"type":"string","format":"date-time"})"),
            {R"("2024-02-29T23:59:59Z")", R"("2024-02-29T00:00:00.123+05:30")"},
            {R"("2024-02-29 23:59:59Z")", R"("2024-02-29T24:00:00Z")", R"("2024-02-29T23:59:59")"});
  ExpectAll(Compile(R"({"type":"string","format":"time"})"), {R"("12:30:00Z")"}, {R"("12:30")"});
  ExpectAll(Compile(R"({"type":"string","format":"uuid"})"),
            {R"("123e4567-e89b-12d3-a456-426614174000")"},
            {R"("123e4567e89b12d3a456426614174000")"});
  ExpectAll(Compile(R"({"type":"string","format":"email"})"), {R"("a.b+c@example.co.uk")"},
            {R"("a@b")", R"("@example.com")", R"("a..b@x.com")"});
}

TEST(JsonSchemaTest, NumericBounds) {
  ExpectAll(Compile(R"({"type":"integer","minimum":-9007199254740991,
                        "maximum":9007199254740991})"),
            {"0", "9007199254740991", "-9007199254740991", "123"},
            {"9007199254740992", "-9007199254740992", "9999999999999999"});
  ExpectAll(Compile(R"({"type":"integer","minimum":1,"maximum":100})"), {"1", "42", "100"},
            {"0", "101", "-1", "1000"});
  ExpectAll(Compile(R"({"type":"integer","exclusiveMinimum":0})"), {"1", "12345"},
            {"0", "-1", "-0"});
  ExpectAll(Compile(R"({"type":"integer","minimum":-5,"exclusiveMaximum":-1})"), {"-5", "-2"},
            {"-1", "0", "-6", "3"});
  ExpectAll(Compile(R"({"type":"integer","minimum":2.5,"maximum":7.5})"), {"3", "7"}, {"2", "8"});
  ExpectAll(Compile(R"({"type":"number","minimum":0,"maximum":1})"),
            {"0", "1", "0.5", "0.999", "1.0", "1.000", "0.0"},
            {"-0.1", "1.01", "2", "-1", "1e0", "-0"});
  ExpectAll(Compile(R"({"type":"number","exclusiveMinimum":0})"), {"0.01", "5", "1.5"},
            {"0", "0.0", "-1", "-0.5"});
  ExpectAll(Compile(R"({"type":"number","minimum":-2,"exclusiveMaximum":3})"),
            {"-2", "-1.5", "-2.0", "2.999", "0"}, {"-2.5", "3", "3.0", "-3"});
  ExpectAll(Compile(R"({"type":"number","maximum":-1})"), {"-1", "-1.5", "-100"},
            {"-0.5", "0", "1"});
}

TEST(JsonSchemaTest, Whitespace) {
  auto g = Compile(R"({"type":"object","properties":{"a":{"type":"array"}}})");
  ExpectAll(g, {"{\"a\" : [ 1 ,\t2 ] }", "{\r\n\"a\":[]}"},
            {"{   \"a\":[]}", "{\"a\":[1 ,   2]}", " {}", "{} "});
  JsonSchemaOptions o;
  o.max_whitespace = 0;
  ExpectAll(Compile(R"({"type":"object"})", o), {"{}", R"({"a":[1,2]})"}, {"{ }", R"({"a": 1})"});
  o.max_whitespace = 9;  // a newline and 8 spaces: pretty-printed, 2 levels deep
  ExpectAll(Compile(R"({"type":"object"})", o), {"{\n    \"a\": [\n        1\n    ]\n}"},
            {"{          }"});
}

TEST(JsonSchemaTest, AnyJsonObject) {
  auto g = AnyJsonObject();
  ExpectAll(g, {"{}", R"({"a":1,"b":[true,null,"x",{"c":-1.5e3}]})"},
            {"[]", "1", "\"a\"", "{", R"({"a":})", R"({"a" 1})"});
  Matcher m(g);
  EXPECT_EQ(m.NextBytes().count(), 1u);       // only '{'
  EXPECT_EQ(AnyJsonObject().get(), g.get());  // built once for the default options
  JsonSchemaOptions o;
  o.max_whitespace = 0;
  auto compact = AnyJsonObject(o);
  EXPECT_NE(compact.get(), g.get());
  ExpectAll(compact, {R"({"a":[1]})"}, {R"({"a": [1]})"});
}

TEST(JsonSchemaTest, TrueAndEmptySchemaAreAnyValue) {
  for (const char* schema : {"{}", "true", R"({"description":"anything"})"}) {
    ExpectAll(Compile(schema), {"1", "\"s\"", "null", "[{}]", R"({"a":[1]})"}, {"", "nul", "[1,]"});
  }
}

TEST(JsonSchemaTest, ErrorsNameKeywordAndPointer) {
  EXPECT_EQ(CompileError(R"({"type":"object","properties":{"tags":{"type":"object",
                             "patternProperties":{"x":{}}}}})"),
            "unsupported keyword 'patternProperties' at /properties/tags");
  EXPECT_EQ(CompileError(R"({"type":"integer","multipleOf":2})"),
            "unsupported keyword 'multipleOf' at /");
  EXPECT_EQ(CompileError(R"({"type":"array","items":{"type":"string","format":"hostname"}})"),
            "unsupported 'format' \"hostname\" (supported: date-time, date, time, uuid, email) "
            "at /items");
  EXPECT_NE(CompileError(R"({"type":"string","pattern":"(a)\\1"})").find("'pattern'"),
            std::string::npos);
  EXPECT_NE(CompileError(R"js({"type":"string","pattern":"a(?=b)"})js").find("lookaround"),
            std::string::npos);
  EXPECT_NE(CompileError(R"({"properties":{"p":{"type":"string","pattern":"^a\\bc$"}}})")
                .find("at /properties/p"),
            std::string::npos);
  EXPECT_EQ(CompileError(R"({"$defs":{"a":{"type":"number","minimum":0.5}},
                             "$ref":"#/$defs/a"})"),
            "'minimum' 0.5: only integer bounds are supported for type number at /$defs/a");
  EXPECT_EQ(CompileError(R"({"anyOf":[{"type":"string"},{"type":"string","minItems":1}]})"),
            "keyword 'minItems' (for type array) does not apply to the schema's type at /anyOf/1");
  EXPECT_EQ(CompileError(R"({"allOf":[{"type":"string"},{"minLength":1}]})"),
            "'allOf' with other than one schema is not supported at /");
  EXPECT_EQ(CompileError(R"({"$ref":"other.json#/a"})"),
            "unsupported '$ref' \"other.json#/a\" (only local JSON pointers: #, #/$defs/Name) "
            "at /");
  EXPECT_EQ(CompileError(R"({"$ref":"#/$defs/missing"})"),
            "'$ref' \"#/$defs/missing\" points to nothing at /");
  EXPECT_EQ(CompileError(R"({"type":"object","properties":{"a/b":{"type":"string",
                             "maxLength":100000}}})"),
            "'maxLength' 100000 is above the supported maximum 10000 at /properties/a~1b");
  EXPECT_EQ(CompileError(R"({"type":"object","required":["x"],"additionalProperties":false})"),
            "required property 'x' is not in 'properties' and additionalProperties is false at /");
  EXPECT_EQ(CompileError(R"({"$ref":"#","type":"object"})"),
            "keyword 'type' alongside '$ref' is not supported at /");
  EXPECT_EQ(CompileError(R"({"type":"strin"})"), "unknown 'type' \"strin\" at /");
  EXPECT_EQ(CompileError(R"({"not":{}})"), "unsupported keyword 'not' at /");
  EXPECT_EQ(CompileError(R"({"type":"array","uniqueItems":true})"),
            "unsupported keyword 'uniqueItems' at /");
  EXPECT_EQ(CompileError(R"({"type":"object","minProperties":1})"),
            "unsupported keyword 'minProperties' at /");
  EXPECT_EQ(CompileError(R"({"type":"number","exclusiveMinimum":true})"),
            "'exclusiveMinimum' must be a number (the boolean form of draft 4 is not supported) "
            "at /");
  EXPECT_EQ(CompileError("false"), "the schema matches no JSON value");
  EXPECT_EQ(CompileError(R"({"type":"string","minLength":3,"maxLength":2})"),
            "the schema matches no JSON value");
  EXPECT_NE(CompileError(R"({"$defs":{"a":{"anyOf":[{"$ref":"#/$defs/a"},{"type":"null"}]}},
                             "$ref":"#/$defs/a"})")
                .find("left recursion"),
            std::string::npos);
  // Infinite only: a tree whose every node needs a child.
  EXPECT_EQ(CompileError(R"({"$defs":{"n":{"type":"object","properties":{"c":{"$ref":
                             "#/$defs/n"}},"required":["c"]}},"$ref":"#/$defs/n"})"),
            "the schema matches no JSON value");
  // Options out of range name the option.
  JsonSchemaOptions o;
  o.max_integer_digits = 19;
  auto g = CompileJsonSchema(Json::parse("{}"), o);
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().message(), "option max_integer_digits = 19 is outside [1, 18]");
  // A schema too large for the state limit.
  o = {};
  o.max_states = 1000;
  g = CompileJsonSchema(Json::parse(R"({"type":"string","maxLength":5000})"), o);
  ASSERT_FALSE(g.ok());
  EXPECT_NE(g.status().message().find("too large"), std::string::npos);
}

TEST(JsonSchemaTest, IgnoredAnnotations) {
  ExpectAll(Compile(R"({"$schema":"https://json-schema.org/draft/2020-12/schema","$id":"x",
                        "title":"T","description":"D","default":1,"examples":[1],
                        "$comment":"c","strict":true,"type":"integer"})"),
            {"1"}, {"\"1\""});
}

TEST(JsonSchemaTest, EqualSchemasHaveEqualFingerprints) {
  auto a = Compile(R"({"type":"object","properties":{"a":{"type":"string"}}})");
  auto b = Compile(R"({"type":"object","properties":{"a":{"type":"string"}}})");
  auto c = Compile(R"({"type":"object","properties":{"b":{"type":"string"}}})");
  EXPECT_NE(a->id(), b->id());
  EXPECT_EQ(a->fingerprint(), b->fingerprint());
  EXPECT_TRUE(a->SameAutomaton(*b));
  EXPECT_NE(a->fingerprint(), c->fingerprint());
  EXPECT_FALSE(a->SameAutomaton(*c));
}

// The server's cache: the same schema text gives the same grammar object (compiled
// once), another schema or another key order another one, and an error is not kept.
TEST(JsonSchemaTest, TheCacheCompilesASchemaOnce) {
  const auto sorted = nlohmann::json::parse(R"({"type":"object","properties":{"b":{},"a":{}}})");
  auto first = CompileJsonSchemaCached(sorted);
  auto second = CompileJsonSchemaCached(nlohmann::json::parse(sorted.dump()));
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(first->get(), second->get());
  auto ordered =
      CompileJsonSchemaCached(Json::parse(R"({"type":"object","properties":{"b":{},"a":{}}})"));
  ASSERT_TRUE(ordered.ok()) << ordered.status();
  EXPECT_NE(first->get(), ordered->get());  // "b" first: another automaton
  const auto bad = nlohmann::json::parse(R"({"type":"string","not":{}})");
  EXPECT_FALSE(CompileJsonSchemaCached(bad).ok());
  EXPECT_FALSE(CompileJsonSchemaCached(bad).ok());
}

}  // namespace
}  // namespace fwserve::constraints
