// Fields: each typed read returns the value given, falls back or fails as its null rule says,
// and every failure names the file, the field's path and what the field must be, in one form.
#include "util/json_fields.h"

#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "util/error.h"
#include "util/error_of.h"

namespace tandem {
namespace {

using nlohmann::json;
using testing::error_of;
using Null = Fields::Null;

const json kDoc = json::parse(R"({
  "n": 7, "x": 2.5, "yes": true, "name": "qwen", "ids": [1, 2], "obj": {"k": 1},
  "none": null, "text": "7", "huge": 18446744073709551615
})");

TEST(Fields, TypedReadsReturnTheValuesGiven) {
  auto f = Fields::strict(kDoc, "c.json");
  EXPECT_EQ(f.integer("n"), 7);
  EXPECT_EQ(f.number("x"), 2.5);
  EXPECT_EQ(f.number("n"), 7.0);  // an integer is a number
  EXPECT_TRUE(f.boolean("yes"));
  EXPECT_EQ(f.string("name"), "qwen");
  EXPECT_EQ(f.list("ids"), json({1, 2}));
  EXPECT_EQ(f.object("obj"), json({{"k", 1}}));
  EXPECT_EQ(f.integers("ids"), (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(f.integers("n"), (std::vector<int64_t>{7}));
  EXPECT_EQ(f.optional_string("name"), "qwen");
}

TEST(Fields, AWrongTypeNamesTheFileTheFieldWhatItMustBeAndTheValue) {
  auto f = Fields::strict(kDoc, "c.json", "model");
  EXPECT_EQ(error_of([&] { f.integer("text"); }),
            "c.json: field 'model.text' must be an integer, got \"7\"");
  EXPECT_EQ(error_of([&] { f.integer("x"); }),
            "c.json: field 'model.x' must be an integer, got 2.5");
  EXPECT_EQ(error_of([&] { f.number_or("text", 1); }),
            "c.json: field 'model.text' must be a number, got \"7\"");
  EXPECT_EQ(error_of([&] { f.boolean_or("n", false); }),
            "c.json: field 'model.n' must be true or false, got 7");
  EXPECT_EQ(error_of([&] { f.optional_string("n"); }),
            "c.json: field 'model.n' must be a string, got 7");
  EXPECT_EQ(error_of([&] { f.list("obj"); }),
            "c.json: field 'model.obj' must be a list, got {\"k\":1}");
  EXPECT_EQ(error_of([&] { f.object("ids"); }),
            "c.json: field 'model.ids' must be an object, got [1,2]");
  EXPECT_EQ(error_of([&] { f.integers("text"); }),
            "c.json: field 'model.text' must be an integer or a list of integers, got \"7\"");
  // get<int64_t>() would have wrapped this to -1.
  EXPECT_EQ(error_of([&] { f.integer("huge"); }),
            "c.json: field 'model.huge' is 18446744073709551615, above the limit of "
            "9223372036854775807");
}

TEST(Fields, AnElementOfAListIsNamedByItsIndex) {
  const json doc = {{"eos", {1, "2"}}};
  auto f = Fields::strict(doc, "c.json");
  EXPECT_EQ(error_of([&] { f.integers("eos"); }),
            "c.json: field 'eos[1]' must be an integer, got \"2\"");
}

TEST(Fields, AMissingRequiredFieldSaysWhatItMustBe) {
  auto f = Fields::lenient(kDoc, "t.json", "normalizer");
  EXPECT_EQ(error_of([&] { f.string("prepend"); }),
            "t.json: field 'normalizer.prepend' is required (a string)");
  EXPECT_EQ(error_of([&] { f.integer("absent"); }),
            "t.json: field 'normalizer.absent' is required (an integer)");
  EXPECT_EQ(error_of([&] { f.number("absent"); }),
            "t.json: field 'normalizer.absent' is required (a number)");
  EXPECT_EQ(error_of([&] { f.boolean("absent"); }),
            "t.json: field 'normalizer.absent' is required (true or false)");
  EXPECT_EQ(error_of([&] { f.list("absent"); }),
            "t.json: field 'normalizer.absent' is required (a list)");
  EXPECT_EQ(error_of([&] { f.object("absent"); }),
            "t.json: field 'normalizer.absent' is required (an object)");
  EXPECT_EQ(error_of([&] { f.need("absent"); }), "t.json: field 'normalizer.absent' is required");
}

TEST(Fields, NullIsAbsentByDefault) {
  auto f = Fields::strict(kDoc, "c.json");
  EXPECT_EQ(f.get("none"), nullptr);
  EXPECT_FALSE(f.present("none"));
  EXPECT_EQ(f.integer_or("none", 3), 3);
  EXPECT_EQ(f.number_or("none", 1.5), 1.5);
  EXPECT_TRUE(f.boolean_or("none", true));
  EXPECT_EQ(f.string_or("none", "d"), "d");
  EXPECT_EQ(f.optional_integer("none"), std::nullopt);
  EXPECT_EQ(f.optional_number("none"), std::nullopt);
  EXPECT_EQ(f.optional_string("none"), std::nullopt);
  EXPECT_TRUE(f.integers("none").empty());
  EXPECT_EQ(error_of([&] { f.string("none"); }), "c.json: field 'none' is required (a string)");
}

TEST(Fields, NullIsAWrongTypeWhereTheCallSaysSo) {
  auto f = Fields::lenient(kDoc, "t.json", "model");
  EXPECT_NE(f.get("none", Null::kWrongType), nullptr);
  EXPECT_EQ(error_of([&] { f.boolean_or("none", false, Null::kWrongType); }),
            "t.json: field 'model.none' must be true or false, got null");
  EXPECT_EQ(error_of([&] { f.string("none", Null::kWrongType); }),
            "t.json: field 'model.none' must be a string, got null");
  EXPECT_EQ(error_of([&] { f.list("none", Null::kWrongType); }),
            "t.json: field 'model.none' must be a list, got null");
  EXPECT_EQ(error_of([&] { f.object("none", Null::kWrongType); }),
            "t.json: field 'model.none' must be an object, got null");
  // Absent is still absent.
  EXPECT_FALSE(f.boolean_or("absent", false, Null::kWrongType));
  EXPECT_EQ(error_of([&] { f.string("absent", Null::kWrongType); }),
            "t.json: field 'model.absent' is required (a string)");
}

TEST(Fields, StrictFieldsReportTheFirstFieldNeitherReadNorIgnored) {
  const json doc = {{"a", 1}, {"b", 2}, {"c", nullptr}};
  auto f = Fields::strict(doc, "c.json", "rope_scaling");
  f.integer("a");
  EXPECT_EQ(error_of([&] { f.reject_unknown(); }),
            "c.json: field 'rope_scaling.b' is not a known field of this configuration");
  f.ignore("b");
  f.optional_integer("c");  // read, though null
  EXPECT_NO_THROW(f.reject_unknown());
}

TEST(Fields, AFailedReadStillCountsAsRead) {
  const json doc = {{"a", "x"}};
  auto f = Fields::strict(doc, "c.json");
  EXPECT_FALSE(error_of([&] { f.integer_or("a", 0); }).empty());
  EXPECT_NO_THROW(f.reject_unknown());
}

TEST(Fields, LenientFieldsHaveNoUnknownFieldsToReport) {
  auto f = Fields::lenient(kDoc, "t.json");
  EXPECT_THROW(f.reject_unknown(), std::logic_error);
}

TEST(Fields, WhereAndPathsNameTheObjectInItsDocument) {
  auto doc = Fields::strict(kDoc, "c.json");
  EXPECT_EQ(doc.where(), "c.json");
  EXPECT_EQ(doc.path_of("n"), "n");
  auto nested = Fields::lenient(kDoc, "t.json", "pre_tokenizer.pretokenizers[0]");
  EXPECT_EQ(nested.origin(), "t.json");
  EXPECT_EQ(nested.where(), "t.json: pre_tokenizer.pretokenizers[0]");
  EXPECT_EQ(nested.path_of("pattern"), "pre_tokenizer.pretokenizers[0].pattern");
  EXPECT_EQ(error_of([&] { nested.fail("type", "is not supported"); }),
            "t.json: field 'pre_tokenizer.pretokenizers[0].type' is not supported");
}

TEST(Fields, NestedFieldsNameTheirPathFromTheDocument) {
  const json doc = {{"pattern", {{"String", 5}, {"extra", 1}}}};
  auto f = Fields::strict(doc, "t.json", "normalizer");
  auto pattern = f.nested("pattern");
  EXPECT_EQ(error_of([&] { pattern.string("String"); }),
            "t.json: field 'normalizer.pattern.String' must be a string, got 5");
  EXPECT_EQ(error_of([&] { pattern.reject_unknown(); }),
            "t.json: field 'normalizer.pattern.extra' is not a known field of this configuration");
  EXPECT_NO_THROW(f.reject_unknown());  // 'pattern' was read
  EXPECT_EQ(error_of([&] { f.nested("absent"); }),
            "t.json: field 'normalizer.absent' is required (an object)");
}

TEST(Fields, LimitsNameTheValueAndTheLimit) {
  auto f = Fields::strict(kDoc, "c.json");
  EXPECT_NO_THROW(f.at_most("n", 7, 7));
  EXPECT_EQ(error_of([&] { f.at_most("n", 8, 7); }),
            "c.json: field 'n' is 8, above this engine's limit of 7");
  EXPECT_EQ(error_of([&] { f.positive_at_most("n", 0, 7); }),
            "c.json: field 'n' must be positive, got 0");
  EXPECT_NO_THROW(f.positive_at_most("n", 1, 7));
}

}  // namespace
}  // namespace tandem
